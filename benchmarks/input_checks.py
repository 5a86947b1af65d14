"""What the checks of bad input cost: settings errors before torch loads, and the image check.

1. Wall time of fresh processes (the command a user types, cold imports every time; best and
   median of ``--rounds``): ``stabletrain --help``, ``stabletrain train --help``, a settings
   error (``stabletrain train out=o steps=-1``), and ``python -c "import torch"`` for scale.
   Each also says whether torch was imported.
2. The image check before training (:func:`stabletrain.data.images.find_bad_images`, on a cold
   cache) on 40 and on 5,000 small images (64x64, JPEG and PNG alternating) and on 200 photo-sized
   ones (640x480), against decoding every image the way the dataset does
   (``Image.open(...).convert("RGB")``).

    python benchmarks/input_checks.py [--rounds 5] [--images 40 5000] [--large 200] [--src other/checkout/src]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

_PROBE = """
import sys, time
t = time.perf_counter()
from stabletrain.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("TORCH", "torch" in sys.modules, file=sys.stderr)
"""


def wall_times(args: list[str], rounds: int, cwd: Path, src: Path) -> tuple[list[float], bool]:
    env = dict(os.environ, PYTHONPATH=str(src) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    times, torch_loaded = [], False
    for _ in range(rounds):
        t = time.perf_counter()
        run = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, check=False)
        times.append(time.perf_counter() - t)
        torch_loaded = "TORCH True" in run.stderr
    return times, torch_loaded


def image_folder(root: Path, n: int, height: int, width: int) -> list[Path]:
    """``n`` images: smooth gradients with noise (compressible like photos), JPEG and PNG alternating."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    paths = []
    for i in range(n):
        folder = root / f"class{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / (f"{i:05d}.jpg" if i % 2 else f"{i:05d}.png")
        base = np.stack([(x * (i % 7 + 1)) % 256, (y * 3) % 256, (x + y) % 256], -1).astype(np.float32)
        pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--images", type=int, nargs="+", default=[40, 5000], help="counts of 64x64 images")
    parser.add_argument("--large", type=int, default=200, help="count of 640x480 images")
    parser.add_argument("--src", type=Path, default=SRC,
                        help="the sources the commands of part 1 run (default: this checkout)")
    ns = parser.parse_args()
    print(f"python {sys.version.split()[0]} on {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")

    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        print(f"\n1. fresh processes, best / median of {ns.rounds} (seconds)")
        cases = [
            ("stabletrain --help", ["-c", _PROBE, "--help"]),
            ("stabletrain train --help", ["-c", _PROBE, "train", "--help"]),
            ("stabletrain train out=o steps=-1", ["-c", _PROBE, "train", "out=o", "steps=-1"]),
            ("python -c 'import torch'", ["-c", "import torch"]),
        ]
        for name, args in cases:
            times, loaded = wall_times(args, ns.rounds, cwd, ns.src)
            torch_note = "" if args[0] == "-c" and "import torch" in args[1] else f"  torch imported: {loaded}"
            print(f"  {name:<36} {min(times):6.2f} / {statistics.median(times):6.2f}{torch_note}")

        from PIL import Image

        import stabletrain.data.images as images

        print("\n2. image check before training vs. decoding every image (cold cache, one pass)")
        for n, (h, w) in [*((n, (64, 64)) for n in ns.images), (ns.large, (480, 640))]:
            paths = image_folder(cwd / f"images{n}x{w}", n, h, w)
            images._checked.clear()
            t = time.perf_counter()
            bad = images.find_bad_images(paths)
            check = time.perf_counter() - t
            t = time.perf_counter()
            for p in paths:
                with Image.open(p) as img:
                    img.convert("RGB")
            decode = time.perf_counter() - t
            assert not bad, bad
            print(f"  {n:>5} images {w}x{h}: check {check * 1e3:8.1f} ms ({check / n * 1e6:5.0f} us/image); "
                  f"decode all {decode * 1e3:8.1f} ms ({decode / n * 1e6:5.0f} us/image)")


if __name__ == "__main__":
    main()
