"""Every Python snippet in the README runs as written (each in a fresh interpreter, the many-hosts
one under torchrun with two ranks on this machine)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("number", range(len(SNIPPETS)))
def test_readme_snippet_runs(number, tmp_path):
    code = SNIPPETS[number]
    script = tmp_path / f"snippet_{number}.py"
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(script)]
    if "ShardedGearStorage(" in code:  # the torchrun snippet: two ranks on this machine (the Ray one starts Ray)
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            str(script),
        ]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"README snippet {number} failed:\n{code}\n--- output ---\n{run.stdout}\n{run.stderr}"
    assert run.stdout.strip() or "print(" not in code, "the snippet printed nothing"


def test_the_readme_has_its_snippets():
    assert len(SNIPPETS) >= 4
