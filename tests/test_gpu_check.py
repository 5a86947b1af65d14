"""benchmarks/gpu_check.sh on a machine without CUDA: one SKIP line per section, exit 0, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import cli_env

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("fp16 GradScaler capture/replay/diagnose", "bf16-mixed training and capture", "FSDP2 on 1 GPU",
            "monitor overheads and host syncs on the benchmark LM", "skip-aware optimizer step bitwise against torch's",
            "FSDP2 at scale: sharded checkpoints, skip_step, compile, fp16")


def test_gpu_check_skips_every_section_without_cuda():
    env = {**cli_env(), "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "Traceback" not in out
    skips = [line for line in p.stdout.splitlines() if line.startswith("SKIP ")]
    assert skips == [f"SKIP {s}: no CUDA device (torch.cuda.is_available() is False)" for s in SECTIONS], out
    assert not any(line.startswith(("PASS", "FAIL")) for line in p.stdout.splitlines())


def test_gpu_check_rejects_an_unknown_section():
    env = {**cli_env(), "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--only", "fp16,fp8"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "unknown section(s) ['fp8']" in p.stderr
