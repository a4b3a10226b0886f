"""A valid header for every op the broker accepts, with its payload: the base that fuzz and schema tests mutate."""

from __future__ import annotations

from typing import Any

from prorl_cli import protocol as P

INSTANCE = P.pack_obj({"echo": 1})

VALID: dict[P.Op, tuple[dict[str, Any], list[bytes]]] = {
    P.Op.SUBMIT: ({"rid": 1, "jobs": [{"job_id": "s1", "task": "test", "timeout_s": 5.0, "stage_timeouts_s": {"run": 2.0},
                                       "sampling": {"max_tokens": 8, "temperature": 0.5}, "max_attempts": 2,
                                       "group_id": "g", "meta": {"k": 1}}]}, [INSTANCE]),
    P.Op.CANCEL: ({"rid": 1, "job_ids": ["x"]}, []),
    P.Op.WATCH: ({"rid": 1, "job_ids": ["x"]}, []),
    P.Op.FORGET: ({"rid": 1, "job_ids": ["x"]}, []),
    P.Op.STATUS: ({"rid": 1}, []),
    P.Op.LIST_JOBS: ({"rid": 1, "prefix": "run1-", "group_id": "run1-0", "after": 0}, []),
    P.Op.ADD_LLM_SERVER: ({"rid": 1, "url": "http://127.0.0.1:9/v1", "model": "m"}, []),
    P.Op.CLEAR_LLM_SERVER: ({"rid": 1, "url": "http://127.0.0.1:9/v1"}, []),
    P.Op.LIST_LLM_SERVERS: ({"rid": 1}, []),
    P.Op.PAUSE_GENERATION: ({"rid": 1, "policy_version": 3, "drain_timeout_s": 1.5}, []),
    P.Op.UPDATE_WEIGHTS: ({"rid": 1, "checkpoint": "/ckpt/v3", "policy_version": 3, "load_timeout_s": 60.0}, []),
    P.Op.WEIGHTS_UPDATED: ({"rid": 1, "error": {"code": "reload_failed", "message": "no"}}, []),
    P.Op.RESUME_GENERATION: ({"rid": 1, "policy_version": 3}, []),
    P.Op.START: ({"rid": 1}, []),
    P.Op.HOLD: ({"rid": 1}, []),
    P.Op.PING: ({"rid": 1}, []),
    P.Op.REGISTER: ({"rid": 1, "node_id": "fz", "host": "h", "pid": 5, "credit": 1, "tasks": ["zzz-no-such-task"],
                     "running": [{"job_id": "x", "attempt": 1, "stage": "run"}], "liveness_token": "tok"}, []),
    P.Op.HEARTBEAT: ({"node_id": "fz", "stages": {"init": {"active": 0, "queued": 0, "limit": 4}},
                      "liveness_token": "tok"}, []),
    P.Op.UNREGISTER: ({"node_id": "fz"}, []),
    P.Op.JOB_STAGE: ({"updates": [{"job_id": "x", "attempt": 1, "stage": "run"}]}, []),
    P.Op.JOB_DONE: ({"jobs": [{"job_id": "x", "attempt": 1, "state": "done"}]}, [P.pack_obj({})]),
    P.Op.GENERATE: ({"rid": 1, "job_id": "x", "sampling": {"max_tokens": 4}}, [P.pack_tokens([1, 2])]),
    P.Op.REGISTER_BACKEND: ({"rid": 1, "backend_id": "fzb", "host": "h", "model": "m", "max_model_len": 128,
                             "capacity": 2}, []),
    P.Op.GENERATE_REPLY: ({"rid": 99, "finish_reason": "stop"}, [P.pack_tokens([1]), P.pack_floats([0.0])]),
    P.Op.GENERATE_DONE: ({"job_id": "x", "backend_id": "http://127.0.0.1:9/v1"}, []),
    P.Op.GENERATE_CANCEL: ({"rid": 1, "job_id": "x"}, []),
}
# Not fuzzed over a live socket: it ends the deployment.
STOP: tuple[dict[str, Any], list[bytes]] = ({"rid": 1}, [])
# A node's own request to hand back unstarted jobs (from a peer that is no node: refused).
RELEASE: tuple[dict[str, Any], list[bytes]] = ({"rid": 1, "job_ids": ["x"]}, [])

#: What the broker sends to a node (``assign``, ``cancel_job``, ``generate_held``, ``shutdown``) and to a
#: bridge (``generate``, ``update_weights``, ``generate_cancel``): the input a node's and a bridge's fuzz mutate.
TO_NODE: dict[P.Op, tuple[dict[str, Any], list[bytes]]] = {
    P.Op.ASSIGN: ({"jobs": [P.JobSpec(job_id="a1", task="test").to_wire()], "timing": [[]]}, [INSTANCE]),
    P.Op.CANCEL_JOB: ({"job_ids": ["a1"]}, []),
    P.Op.GENERATE_HELD: ({"rid": 1, "job_id": "a1", "held": True}, []),
}
TO_BRIDGE: dict[P.Op, tuple[dict[str, Any], list[bytes]]] = {
    P.Op.GENERATE: ({"rid": 1, "job_id": "a1", "sampling": {"max_tokens": 4}}, [P.pack_tokens([1, 2])]),
    P.Op.UPDATE_WEIGHTS: ({"rid": 1, "checkpoint": "/no/such/ckpt", "policy_version": 3, "load_timeout_s": 5.0}, []),
    P.Op.GENERATE_CANCEL: ({"rid": 1, "job_id": "a1"}, []),
}
