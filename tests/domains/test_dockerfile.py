"""Dockerfile recipes: spython conversion, what is not converted, refused shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from prorl_cli.exceptions import ConfigError
from prorl_cli.images.dockerfile import convert_dockerfile
from prorl_cli.images.spec import is_dockerfile, parse_image


def _convert(tmp_path: Path, text: str, base: str = "localimage:/x/base.sif") -> object:
    (tmp_path / "Dockerfile").write_text(text)
    (tmp_path / "app").mkdir(exist_ok=True)
    (tmp_path / "app" / "main.py").write_text("print(1)\n")
    spec = parse_image("img", {"template": "Dockerfile", "base": base}, "images.yaml: images.img", tmp_path, None)
    return convert_dockerfile(tmp_path / "Dockerfile", spec, header="Bootstrap: localimage\nFrom: /x/base.sif",
                              prorl_version="0")


def test_conversion_keeps_what_apptainer_can_express(tmp_path: Path) -> None:
    conv = _convert(tmp_path, "FROM python:3.11-slim\nENV A=1\nCOPY app /opt/app\nRUN echo built > /opt/stamp\n"
                              "WORKDIR /opt/app\nUSER nobody\nEXPOSE 80\nVOLUME /data\nCMD [\"python3\", \"main.py\"]\n")
    d = conv.definition  # type: ignore[attr-defined]
    assert d.startswith("Bootstrap: localimage\nFrom: /x/base.sif\n")
    assert f"{tmp_path}/app/. /opt/app" in d and "tool_server" not in d  # the runtimes bind the tool server
    assert "echo built > /opt/stamp" in d and "export A=1" in d and "org.prorl.image img" in d
    assert "su -" not in d and "Bootstrap: docker" not in d
    notes = conv.not_converted  # type: ignore[attr-defined]
    assert [n.split(" - ")[0] for n in notes[:3]] == ["line 6: USER nobody", "line 7: EXPOSE 80", "line 8: VOLUME /data"]
    assert notes[3] == "FROM python:3.11-slim: replaced by the image list's base localimage:/x/base.sif"
    assert [f.dst for f in conv.files] == ["/opt/app"]  # type: ignore[attr-defined]
    assert is_dockerfile("Dockerfile") and is_dockerfile("x/Dockerfile.swe") and not is_dockerfile("python.def.j2")


def test_refused_shapes_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no FROM line"):
        _convert(tmp_path, "ARG A=1\nRUN x\n")
    with pytest.raises(ConfigError, match="line 3: COPY --from=c names a stage that is not defined before it"):
        _convert(tmp_path, "FROM a AS b\nRUN x\nCOPY --from=c /x /x\nFROM b AS c\n")
    with pytest.raises(ConfigError, match="COPY source 'missing' does not exist"):
        _convert(tmp_path, "FROM a\nCOPY missing /x\n")


def test_from_with_a_platform_flag_names_its_image_and_a_bare_from_is_refused(tmp_path: Path) -> None:
    conv = _convert(tmp_path, "FROM --platform=linux/amd64 python:3.11-slim AS app\nRUN echo hi\n",
                    base="docker://python:3.11-slim")
    assert conv.from_image == "python:3.11-slim"  # type: ignore[attr-defined]
    assert conv.not_converted == []  # type: ignore[attr-defined]  # the base is what FROM names: nothing replaced
    with pytest.raises(ConfigError, match="FROM names no image"):
        _convert(tmp_path, "FROM\nRUN echo hi\n")
