"""Inference: the generate contract, engines, the bridge to the broker, and the node side.

Heavy dependencies (torch, transformers, vllm) are imported only inside the
engines that need them.
"""

from prorl_cli.inference.contract import Engine, Generation
from prorl_cli.inference.node_client import NodeInference
from prorl_cli.inference.settings import InferenceConfig

__all__ = ["Engine", "Generation", "InferenceConfig", "NodeInference"]
