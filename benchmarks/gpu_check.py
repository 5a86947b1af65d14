"""Everything in stabletrain that needs CUDA, in one run of a few minutes (issue 13, "The GPU path").

Sections, each printing PASS / FAIL / SKIP lines with the numbers behind them:

1. ``fp16``: ``precision=16-mixed`` on cuda (a real ``torch.amp.GradScaler``). (a) FaultNet
   ("square": x = 2000 in one sample of step 2 squares past float16's 65504), 8 steps at most,
   batch 8: nancapture writes a capture, ``load_nan_capture(...).replay()`` reproduces it,
   ``diagnose`` calls it precision-induced and names the sample. (b) PoisonNet, whose scaled
   gradients overflow float16 step after step: the GradScaler skips, and after
   ``max_skipped_steps=2`` the step is captured, replayed and diagnosed.
2. ``bf16``: the built-in LM (defaults, batch 32) trains 30 steps in ``bf16-mixed``; every logged
   loss and gradient_norm is finite. BCENet (sigmoid rounds to 1 in bfloat16, log(1 - p) = -inf
   at one sample of step 2, 8 steps at most) is captured, replayed and diagnosed.
3. ``fsdp``: ``strategy=fsdp devices=1`` trains the built-in LM 5 steps in 32-true; its parameters
   must be DTensors (FSDP2's ``fully_shard``) and its step-0 loss and gradient_norm must equal a
   plain single-GPU run's (rel 1e-3). SKIP with stabletrain's ConfigError when it refuses the setting.
4. ``overhead``: the benchmark scripts of this folder on the device: ``nancapture_overhead.py
   --rounds 30``, ``underflow_overflow_overhead.py --rounds 12``, ``guard_overhead.py --rounds 60``,
   ``mechanism_signals.py --rounds 30`` (each with ``--device``; 3, 2, 4 and 2 rounds with
   ``--device cpu``), 240 s at most each. The added host syncs per step decide PASS / FAIL (goals:
   nancapture +1, underflow_overflow <= 2, guard 0, mechanism signals 0 and, on the GPU, no
   synchronising CUDA call added to a logged step); the step-time ratios are printed against
   their CPU goals but do not fail the check (timings scatter). LightlyTrain as a peer: only if
   ``import lightly_train`` works, else SKIP.

5. ``skip_step``: the skip-aware AdamW / Adam / SGD step (``safety/skip_aware.py``) on the device,
   for foreach on and off: its own check against torch must pass (else the copy is used, which is
   correct but costs a copy), and over 8 steps of a small MLP with NaN/Inf gradients on the
   skipped ones, kept steps must equal torch's own step bitwise and skipped ones change nothing,
   with no host sync in the guard's calls.
6. ``scale`` (issue 22): under ``strategy=fsdp devices=1`` (one GPU): (a) the built-in LM 6 steps with
   sharded checkpoints (the default under fsdp) and ``checkpoint_async=true``: the folders hold DCP shards
   and ``meta.pt``, one process reads them back as the full state, and a resume from step 3 logs the
   straight run's losses (rel 1e-5: GPU kernels need not be bitwise); (b) ``on_instability.policy=skip_step``
   on the planted faults of tests/safety/heal_faults.py: exactly steps 25 and 32 recovered; (c)
   ``torch_compile_args.disable=false`` (inductor) with the guard and a NaN planted in the data of a known
   step: the guard stops there; (d) ``precision=16-mixed``: trains with a ``torch.amp.GradScaler``, every
   logged loss finite.

On an H200 the whole run should take 2-4 minutes (not measured yet). Without CUDA every section
prints one SKIP line and the script exits 0. ``--device cpu`` runs the sections on the CPU instead,
to test this script itself (fp16 then goes through Fabric's CPU GradScaler plugin; it takes
several minutes on 2 cores).

    bash benchmarks/gpu_check.sh [--only fp16,bf16,fsdp,overhead,scale] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# This checkout's stabletrain, not whichever one the environment has installed.
sys.path.insert(0, str(ROOT / "src"))
SECTIONS = {
    "fp16": "fp16 GradScaler capture/replay/diagnose",
    "bf16": "bf16-mixed training and capture",
    "fsdp": "FSDP2 on 1 GPU",
    "overhead": "monitor overheads and host syncs on the benchmark LM",
    "skip_step": "skip-aware optimizer step bitwise against torch's",
    "scale": "FSDP2 at scale: sharded checkpoints, skip_step, compile, fp16",
}
NANCAPTURE = {"nancapture": {"enabled": True}}
# The tiny fault runs of tests/debug/test_diagnose.py: 8 samples per step, SGD-free defaults.
FAULT_RUN = dict(steps=8, batch_size=8, num_workers=0, log_every_num_steps=1,
                 model_args={"lr": 0.01, "warmup_steps": 0}, loggers={"tensorboard": {"enabled": False}})


class Checks:
    """Prints one PASS/FAIL/SKIP line per check and remembers whether any failed."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def check(self, name: str, ok: bool, detail: str) -> bool:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        if not ok:
            self.failed.append(name)
        return ok

    def skip(self, name: str, why: str) -> None:
        print(f"SKIP {name}: {why}", flush=True)

    def note(self, text: str) -> None:
        print(f"     {text}", flush=True)


def fault_helpers() -> None:
    """The planted-fault models of the CPU tests (tests/debug/), so the GPU runs the same faults."""
    sys.path.insert(0, str(ROOT / "tests" / "debug"))


def expect_nan(run: Callable[[], Any]) -> Any:
    """The NaNDetectedError that ``run`` raises, or None when it finished without one."""
    from stabletrain import NaNDetectedError

    try:
        run()
    except NaNDetectedError as err:
        return err
    return None


def train_fp16(device: str, settings: dict[str, Any]) -> None:
    import stabletrain

    if device == "cuda":
        stabletrain.train(precision="16-mixed", accelerator="cuda", devices=1, **settings)
        return
    # Fabric turns 16-mixed on the CPU into bf16-mixed; its plugin keeps float16 and a CPU GradScaler.
    import torch
    from lightning_fabric import Fabric
    from lightning_fabric.plugins import MixedPrecision

    from stabletrain.config import load_settings
    from stabletrain.training.loop import Trainer

    fabric = Fabric(accelerator="cpu", devices=1,
                    plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))])
    Trainer(load_settings(settings), fabric=fabric).fit()


def check_capture(ck: Checks, name: str, err: Any, model: Any, precision: str, want_reason: str,
                  want_step: int | None, victim: int | None) -> None:
    """The capture behind ``err``: loaded, replayed (reproduced) and diagnosed (precision-induced)."""
    import stabletrain
    from stabletrain.debug.diagnose import PRECISION_INDUCED

    if not ck.check(f"{name} capture", err is not None and err.reason == want_reason
                    and (want_step is None or err.step == want_step),
                    "no NaNDetectedError" if err is None else
                    f"NaNDetectedError at step {err.step}, reason {err.reason} (want {want_reason}"
                    + (f" at step {want_step})" if want_step is not None else ")")
                    + f", {err.capture_path} ({Path(err.capture_path).stat().st_size:,} bytes)"):
        return
    cap = stabletrain.load_nan_capture(err.capture_path, model=model)
    ck.check(f"{name} load_nan_capture", cap.precision == precision and cap.step == err.step
             and (precision != "16-mixed" or (cap.loss_scale or 0) > 0),
             f"precision {cap.precision}, step {cap.step}, loss scale {cap.loss_scale}, "
             f"device {cap.default_device()}")
    t0 = time.perf_counter()
    r = cap.replay()
    ck.check(f"{name} replay", r.reproduced,
             f"reproduced {r.reproduced} on {r.device} in {time.perf_counter() - t0:.1f} s; losses "
             f"{[f'{x:.4g}' for x in r.losses]} (captured {[f'{x:.4g}' for x in r.captured_losses]}), "
             f"bitwise equal {r.losses_bitwise_equal}, non-finite gradients in {len(r.nan_param_names)} parameter(s)")
    t0 = time.perf_counter()
    d = cap.diagnose()
    f = d.finding
    where = f"{f.op} in {f.module or '(outside any module)'} ({f.phase}, {f.dtype})" if f is not None else "no finding"
    want_in = {precision: True, "32-true": False, "64-true": False}
    ok = d.cause == PRECISION_INDUCED and d.reproduces_in == want_in
    if victim is not None:
        ok = ok and d.data.dataset_indices == [victim]
    ck.check(f"{name} diagnose", ok,
             f"{time.perf_counter() - t0:.1f} s; cause {d.cause} (want {PRECISION_INDUCED}); reproduces in "
             f"{d.reproduces_in}; {where}; culprit samples {d.data.dataset_indices}"
             + (f" (planted {victim})" if victim is not None else ""))


def section_fp16(ck: Checks, device: str, tmp: Path) -> None:
    fault_helpers()
    from fault_models import FAULTS, FaultData, FaultNet
    from nan_models import PoisonData, PoisonNet, samples_of_step

    victim = samples_of_step(2)[5]
    settings = {"out": tmp / "fp16_square", "model": FaultNet("square"),
                "data": FaultData(plant={victim: FAULTS["square"][0]}), "debug_args": NANCAPTURE, **FAULT_RUN}
    err = expect_nan(lambda: train_fp16(device, settings))
    check_capture(ck, "fp16 overflow of an activation", err, FaultNet("square"), "16-mixed", "nonfinite_loss", 2,
                  victim)

    settings = {"out": tmp / "fp16_skips", "model": PoisonNet(), "data": PoisonData(),
                "debug_args": {"nancapture": {"enabled": True, "max_skipped_steps": 2}}, **FAULT_RUN}
    err = expect_nan(lambda: train_fp16(device, settings))
    check_capture(ck, "fp16 GradScaler skipped steps", err, PoisonNet(), "16-mixed", "skipped_steps", None, None)


def read_metrics(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_rows(out: Path) -> list[dict[str, Any]]:
    return [r for r in read_metrics(out) if "loss" in r and "event" not in r]


def section_bf16(ck: Checks, device: str, tmp: Path) -> None:
    import stabletrain

    steps = 30
    t0 = time.perf_counter()
    res = stabletrain.train(out=tmp / "bf16_lm", steps=steps, log_every_num_steps=1, precision="bf16-mixed",
                            accelerator=device, devices=1, checkpoint_every_num_steps=10**6,
                            model_args={"warmup_steps": 3}, loggers={"tensorboard": {"enabled": False}})
    rows = step_rows(res.out)
    finite = [r for r in rows if math.isfinite(r["loss"]) and math.isfinite(r.get("gradient_norm", math.nan))]
    ck.check("bf16-mixed built-in LM", res.steps_done == steps and len(rows) == steps and len(finite) == steps,
             f"{res.steps_done} steps in {time.perf_counter() - t0:.1f} s; {len(finite)}/{len(rows)} rows with finite "
             f"loss and gradient_norm; loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, gradient_norm "
             f"{rows[0].get('gradient_norm', math.nan):.4g} -> {rows[-1].get('gradient_norm', math.nan):.4g}")

    fault_helpers()
    from fault_models import BCEData, BCENet
    from nan_models import samples_of_step

    victim = samples_of_step(2)[3]
    err = expect_nan(lambda: stabletrain.train(out=tmp / "bf16_bce", model=BCENet(), data=BCEData(plant={victim: 20.0}),
                                               precision="bf16-mixed", accelerator=device, devices=1,
                                               debug_args=NANCAPTURE, **FAULT_RUN))
    check_capture(ck, "bf16-mixed rounding (log(1 - sigmoid(10)))", err, BCENet(), "bf16-mixed", "nonfinite_loss", 2,
                  victim)


class ParamKind:
    """Callback: the class of the model's first parameter once training starts (DTensor under FSDP2)."""

    kind = "?"

    def on_train_start(self, trainer: Any) -> None:
        ParamKind.kind = type(next(trainer.model.parameters())).__name__


def section_fsdp(ck: Checks, device: str, tmp: Path) -> None:
    import stabletrain
    from stabletrain import ConfigError

    lm = dict(steps=5, log_every_num_steps=1, precision="32-true", accelerator=device, devices=1,
              checkpoint_every_num_steps=10**6, loggers={"tensorboard": {"enabled": False}})
    t0 = time.perf_counter()
    try:
        res = stabletrain.train(out=tmp / "fsdp", strategy="fsdp", callbacks=[ParamKind()], **lm)
    except ConfigError as exc:
        ck.skip(SECTIONS["fsdp"], f"the installed stabletrain refuses strategy=fsdp devices=1: {exc}")
        return
    seconds = time.perf_counter() - t0
    plain = stabletrain.train(out=tmp / "plain", **lm)
    rows, ref = step_rows(res.out), step_rows(plain.out)
    finite = all(math.isfinite(r["loss"]) and math.isfinite(r["gradient_norm"]) for r in rows)
    ck.check("FSDP2 on 1 GPU trains", res.steps_done == lm["steps"] and finite,
             f"{res.steps_done} steps in {seconds:.1f} s, all losses and gradient norms finite: {finite}; "
             f"losses {[round(r['loss'], 4) for r in rows]}")
    ck.check("FSDP2 shards with fully_shard", ParamKind.kind == "DTensor",
             f"the model's parameters are {ParamKind.kind} (DTensor under FSDP2; anything else is not FSDP2)")
    a, b = rows[0], ref[0]
    rel = {k: abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in ("loss", "gradient_norm")}
    ck.check("FSDP2 step 0 equals a plain single-GPU run", all(v <= 1e-3 for v in rel.values()),
             f"loss {a['loss']:.6g} vs {b['loss']:.6g}, gradient_norm {a['gradient_norm']:.6g} vs "
             f"{b['gradient_norm']:.6g} (relative differences {rel['loss']:.1e}, {rel['gradient_norm']:.1e}; "
             "goal <= 1e-3)")


def run_bench(script: str, args: list[str], timeout: float) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        p = subprocess.run([sys.executable, str(HERE / script), *args], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return -1, f"timed out after {timeout:.0f} s\n{partial}", time.perf_counter() - t0
    return p.returncode, p.stdout + (p.stderr[-3000:] if p.returncode else ""), time.perf_counter() - t0


def find(pattern: str, text: str) -> re.Match[str] | None:
    return re.search(pattern, text, re.MULTILINE)


def section_overhead(ck: Checks, device: str, tmp: Path) -> None:
    # (script, rounds on a GPU, rounds on the CPU: there only to test this script, 2 cores take ~1 s a step)
    benches = [
        ("nancapture_overhead.py", 30, 3),
        ("underflow_overflow_overhead.py", 12, 2),
        ("guard_overhead.py", 60, 4),
        ("mechanism_signals.py", 30, 2),
    ]
    for script, gpu_rounds, cpu_rounds in benches:
        rounds = gpu_rounds if device == "cuda" else cpu_rounds
        rc, out, seconds = run_bench(script, ["--rounds", str(rounds), "--device", device], timeout=240)
        name = f"{script} --device {device}"
        for line in out.rstrip().splitlines():
            ck.note(f"| {line}")
        if rc != 0:
            ck.check(name, False, f"exit code {rc} after {seconds:.0f} s (output above)")
            continue
        if script == "nancapture_overhead.py":
            plain = find(r"^no monitor\s+([\d.]+)\s+(\d+)$", out)
            mon = find(r"^NaNCaptureMonitor\s+([\d.]+)\s+(\d+)$", out)
            ratio = find(r"median over rounds ([\d.]+)x", out)
            if not (plain and mon and ratio):
                ck.check(name, False, "could not read its figures (output above)")
                continue
            added = int(mon[2]) - int(plain[2])
            ck.check(f"nancapture overhead on {device}", added <= 1,
                     f"{float(ratio[1]):.3f}x median step time (CPU goal <= 1.05x; not a pass condition), "
                     f"{plain[1]} -> {mon[1]} ms/step; host syncs per step {plain[2]} -> {mon[2]} (+{added}, goal +1)")
        elif script == "underflow_overflow_overhead.py":
            ours = find(r"^stabletrain UnderflowOverflowMonitor\s+(\d+)\s+([\d.]+)x.*?\s(-?\d+)$", out)
            hf = find(r"^transformers DebugUnderflowOverflow\s+(\d+)\s+([\d.]+)x.*?\s(-?\d+)$", out)
            if not ours:
                ck.check(name, False, "could not read its figures (output above)")
                continue
            peer = f"; transformers DebugUnderflowOverflow {hf[2]}x, +{hf[3]} syncs" if hf else ""
            ck.check(f"underflow_overflow overhead on {device}", int(ours[3]) <= 2,
                     f"stabletrain {ours[2]}x median step time (CPU goal <= 1.15x; not a pass condition), "
                     f"+{ours[3]} host syncs per step (goal <= 2){peer}")
        elif script == "mechanism_signals.py":
            check_mechanism_signals(ck, device, out)
        else:
            alone = find(r"calls alone: ([\d.]+) ms/step = ([\d.]+)% .*-> ([\d.]+)x", out)
            added = find(r"added by the guard, any step: (\d+) \(nancapture off\), (\d+) \(nancapture on\); "
                         r"nancapture on with the guard: \+(\d+)", out)
            if not (alone and added):
                ck.check(name, False, "could not read its figures (output above)")
                continue
            ok = int(added[1]) == 0 and int(added[2]) == 0 and int(added[3]) <= 1
            ck.check(f"guard overhead on {device}", ok,
                     f"the guard's own calls {alone[1]} ms/step = {alone[2]}% -> {alone[3]}x (CPU goal <= 1.01x; "
                     f"not a pass condition); host syncs added {added[1]} / {added[2]} (nancapture off / on), "
                     f"nancapture +{added[3]} (goals 0, 0, +1)")
    lightly_train_peer(ck)


def check_mechanism_signals(ck: Checks, device: str, out: str) -> None:
    """PASS when the signals add no host sync on any step of stabletrain.train and, on a GPU, no
    synchronising CUDA call to a logged step; the step-time ratio is printed, not judged."""
    ratio = find(r"median over rounds ([\d.]+)x", out)
    added = find(r"added by the signals, any step: (-?\d+)", out)
    cuda = find(r"synchronising CUDA calls in a logged step: plain (\d+), signals (\d+)", out)
    name = f"mechanism signals overhead on {device}"
    if not (ratio and added and (cuda or device != "cuda")):
        ck.check(name, False, "could not read its figures (output above)")
        return
    ok = int(added[1]) == 0 and (cuda is None or cuda[1] == cuda[2])
    sync_text = f"; synchronising CUDA calls in a logged step {cuda[1]} -> {cuda[2]} (goal equal)" if cuda else ""
    ck.check(name, ok, f"{float(ratio[1]):.3f}x median step time at one logged step in 10 (CPU goal <= 1.02x; not a "
                       f"pass condition); host syncs added on any step {added[1]} (goal 0){sync_text}")


def lightly_train_peer(ck: Checks) -> None:
    name = "LightlyTrain as a peer"
    if importlib.util.find_spec("lightly_train") is None:
        ck.skip(name, "lightly_train is not installed (import lightly_train fails); nothing to compare against")
    else:
        ck.skip(name, "lightly_train is importable, but no side-by-side benchmark for it exists in benchmarks/ yet")


def section_skip_step(ck: Checks, device: str, tmp: Path) -> None:
    import copy

    import torch

    from stabletrain.safety.instability_guard import InstabilityGuard
    from stabletrain.utils.sync import CountSyncs

    configs = [(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}), (torch.optim.Adam, {"lr": 1e-2}),
               (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-3})]
    for cls, kwargs in configs:
        for foreach in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8)).to(device)
            ref_model = copy.deepcopy(model)
            opt = cls(model.parameters(), foreach=foreach, **kwargs)
            ref = cls(ref_model.parameters(), foreach=foreach, **kwargs)
            guard = InstabilityGuard(opt, warmup=100)
            same, guard_syncs, step_syncs = True, 0, []
            for step in range(8):
                gen = torch.Generator().manual_seed(step)
                grads = [torch.randn(p.shape, generator=gen).to(device) for p in model.parameters()]
                bad = step in (3, 6)
                if bad:
                    grads[0].view(-1)[0] = float("nan")
                for p, r, g in zip(model.parameters(), ref_model.parameters(), grads):
                    p.grad, r.grad = g.clone(), g.clone()
                loss = torch.tensor(float("nan") if bad else 1.0, device=device)
                before = [p.detach().clone() for p in model.parameters()]
                with CountSyncs() as c1:
                    guard.check(step, loss, torch.tensor(1.0, device=device))
                with CountSyncs() as ours:
                    opt.step()
                with CountSyncs() as c2:
                    guard.after_step()
                guard_syncs += c1.count + c2.count
                if bad:
                    same &= all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
                    for s_ref, s_ours in zip(ref.state.values(), opt.state.values()):
                        if "step" in s_ours:
                            s_ref["step"] = s_ours["step"].clone()
                else:
                    with CountSyncs() as theirs:
                        ref.step()
                    step_syncs.append(ours.count - theirs.count)
                    same &= all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                                for a, b in zip(model.parameters(), ref_model.parameters()))
            mode = guard.skipper.mode if guard.skipper is not None else None
            added = max(step_syncs, default=0)
            ck.check(f"skip_step {cls.__name__} foreach={foreach}", mode == "skip_aware" and same
                     and guard_syncs == 0 and added == 0,
                     f"step taken: {mode}; kept steps bitwise torch's and skipped ones unchanged: {same}; host syncs "
                     f"in the guard's calls {guard_syncs}, added by the step over torch's own {added}")
    # The integrations' guard verdict agreed over ranks a step later (one process here): read back from
    # pinned host memory after its asynchronous copy, in order.
    from stabletrain.integrations.device_reads import LaggedAgreement

    agreement, got = LaggedAgreement(), []
    for flag in (False, True, False):
        agreement.start(torch.tensor(flag, device=device))
        got.append(agreement.result())
    ck.check("integrations' lagged guard agreement", got == [False, True, False], f"flags False, True, False read "
             f"back as {got}")




def section_scale(ck: Checks, device: str, tmp: Path) -> None:
    import stabletrain
    from stabletrain import NonFiniteStepError
    from stabletrain.runfiles.checkpoint import is_sharded_checkpoint, list_checkpoints, load_checkpoint

    fsdp = dict(strategy="fsdp", accelerator=device, devices=1, loggers={"tensorboard": {"enabled": False}})
    lm = dict(steps=6, log_every_num_steps=1, checkpoint_every_num_steps=3, precision="32-true", **fsdp)
    res = stabletrain.train(out=tmp / "sharded", checkpoint_async=True, **lm)
    folder = res.out / "checkpoints"
    state = load_checkpoint(folder / "step_000003.ckpt")
    ck.check("sharded checkpoints written and read in one process",
             is_sharded_checkpoint(folder / "step_000003.ckpt") and [c.step for c in list_checkpoints(folder)] == [3, 6]
             and state["health"]["healthy"] and len(state["model"]) > 5,
             f"{sorted(p.name for p in (folder / 'step_000003.ckpt').iterdir())}; health {state['health']['why'][:80]}")
    resumed = stabletrain.train(out=tmp / "resumed", resume_from=str(folder / "step_000003.ckpt"), **lm)
    a, b = step_rows(res.out), step_rows(resumed.out)
    rel = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a[3:], b))
    ck.check("resume from a sharded checkpoint", rel <= 1e-5, f"steps 3-5: largest relative loss difference {rel:.1e}")

    fault_helpers()
    sys.path.insert(0, str(ROOT / "tests" / "safety"))
    from heal_faults import NAN_STEP, SPIKE_STEP, settings

    out = tmp / "heal"
    stabletrain.train(**settings(out, "skip_step", **fsdp))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"recovery"' in line]
    ck.check("skip_step under FSDP2", [r["step"] for r in rows] == [NAN_STEP, SPIKE_STEP],
             f"recovered steps {[r['step'] for r in rows]} (planted: {NAN_STEP}, {SPIKE_STEP})")

    compiled = dict(settings(tmp / "compiled", "stop", **fsdp), torch_compile_args={"disable": False})
    compiled["debug_args"] = {"mechanisms": {"probes": False}}
    try:
        stabletrain.train(**compiled)
        stopped = None
    except NonFiniteStepError as err:
        stopped = err.step
    ck.check("torch.compile (inductor) under FSDP2 with the guard", stopped == NAN_STEP,
             f"the guard stopped at step {stopped} (planted NaN at step {NAN_STEP})")

    half = stabletrain.train(out=tmp / "fp16", **{**lm, "precision": "16-mixed", "checkpoint_every_num_steps": 10**6})
    rows = step_rows(half.out)
    ck.check("16-mixed under FSDP2 with a GradScaler", all(math.isfinite(r["loss"]) for r in rows)
             and all("loss_scale" in r for r in rows),
             f"losses {[round(r['loss'], 4) for r in rows]}, loss scales {[r.get('loss_scale') for r in rows]}")


RUNNERS = {"fp16": section_fp16, "bf16": section_bf16, "fsdp": section_fsdp, "overhead": section_overhead,
           "skip_step": section_skip_step, "scale": section_scale}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections: " + ", ".join(SECTIONS))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: run the sections on the CPU, to test this script")
    ns = parser.parse_args()
    only = [s.strip() for s in ns.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        parser.error(f"--only: unknown section(s) {unknown}; the sections are {', '.join(SECTIONS)}")

    # Only torch is imported before deciding: stabletrain and Lightning take seconds more.
    import torch

    ck = Checks()
    if ns.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__}, no CUDA device: every section skipped")
        for s in only:
            ck.skip(SECTIONS[s], "no CUDA device (torch.cuda.is_available() is False)")
        return 0
    where = torch.cuda.get_device_name(0) if ns.device == "cuda" else "CPU (testing the script)"
    print(f"gpu_check: {where}, torch {torch.__version__}, sections {', '.join(only)}", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for s in only:
            t0 = time.perf_counter()
            print(f"== {s}: {SECTIONS[s]}", flush=True)
            try:
                RUNNERS[s](ck, ns.device, Path(tmp))
            except Exception as exc:  # one broken section must not hide the others' results
                traceback.print_exc()
                ck.check(SECTIONS[s], False, f"{type(exc).__name__}: {exc}")
            print(f"   ({s}: {time.perf_counter() - t0:.0f} s)", flush=True)
    total = time.perf_counter() - start
    verdict = f"FAILED: {', '.join(ck.failed)}" if ck.failed else "no failures"
    print(f"gpu_check: {verdict}; {total:.0f} s in all (goal < 480 s)")
    return 1 if ck.failed else 0


if __name__ == "__main__":
    sys.exit(main())
