"""The signals in ``stabletrain.train``: every value of the built-in language model against a
float64 recomputation of the same step, no host sync added on any step, and what the run says
when a signal cannot be measured (the image task has no attention; torch.compile)."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch

from conftest import tiny_lm
from stabletrain import train
from stabletrain.config import load_settings
from stabletrain.debug.mechanisms import KEYS
from stabletrain.errors import ConfigError
from stabletrain.loggers.jsonl import read_metrics
from stabletrain.tasks.language_model import TransformerLM
from stabletrain.utils.sync import SyncsPerStep

ROOT = Path(__file__).resolve().parents[3]


class Recorder:
    """Each logged step's starting weights, microbatches, the weights after the update and the
    optimizer's state."""

    def __init__(self):
        self.before, self.batches, self.after, self.optimizer = {}, {}, {}, {}

    def on_step_start(self, trainer, *, step):
        self.before[step] = copy.deepcopy(trainer.model.state_dict())
        self.batches[step] = []

    def on_microbatch(self, trainer, *, step, micro_step, batch, indices):
        self.batches[step].append({k: v.clone() for k, v in batch.items()})

    def on_after_optimizer_step(self, trainer, *, step):
        self.after[step] = copy.deepcopy(trainer.model.state_dict())
        self.optimizer[step] = copy.deepcopy(trainer.optimizer.state_dict())


def float64_forward_signals(state: dict, microbatches: list[dict], n_layers: int) -> dict[str, float]:
    """The step's forward passes in float64, attention logits written out from the qkv weights."""
    model = TransformerLM(vocab_size=256, n_layers=n_layers, n_heads=2, dim=32, context_length=16).double()
    model.load_state_dict({k: v.double() for k, v in state.items()})
    maxes = {i: [] for i in range(n_layers)}
    entropies = {i: [] for i in range(n_layers)}
    lse, absmax, means = [], [], []
    with torch.no_grad():
        for batch in microbatches:
            ids = batch["input_ids"]
            t = ids.shape[1]
            x = model.tok_emb(ids) + model.pos_emb(torch.arange(t))
            for i, block in enumerate(model.blocks):
                q, k, _ = block.attn.qkv(block.ln1(x)).view(len(ids), t, 3, 2, 16).permute(2, 0, 3, 1, 4)
                scores = q @ k.transpose(-2, -1) / math.sqrt(16)
                causal = torch.ones(t, t, dtype=torch.bool).tril()
                maxes[i].append(scores.masked_fill(~causal, -math.inf).max().item())
                p = scores.masked_fill(~causal, -math.inf).softmax(-1)
                entropies[i].append(-torch.where(causal, p * p.log(), 0.0).sum(-1).reshape(-1))
                x = block(x)
            logits = model.head(model.ln_f(x)).reshape(-1, 256)
            lse.append(torch.logsumexp(logits, -1))
            means.append(logits.mean(-1))
            absmax.append(logits.abs().max().item())
    out = {}
    for i in range(n_layers):
        out[f"signals/attn_logit_max/blocks.{i}.attn"] = max(maxes[i])
        out[f"signals/attn_entropy/blocks.{i}.attn"] = torch.cat(entropies[i]).mean().item()
    out["signals/attn_logit_max"] = max(max(m) for m in maxes.values())
    out["signals/attn_entropy_min"] = min(torch.cat(e).mean().item() for e in entropies.values())
    out["signals/output_logsumexp"] = torch.cat(lse).mean().item()
    out["signals/output_logit_absmax"] = max(absmax)
    out["signals/output_logit_mean"] = torch.cat(means).mean().item()
    return out


def float64_optimizer_signals(before: dict, after: dict, optimizer_state: dict) -> dict[str, float]:
    """Weight RMS and relative update of the trainer's two groups (matrices decay, the rest not),
    the largest relative update, and AdamW's eps fraction, from the recorded tensors."""
    names = list(before)
    decay = [n for n in names if before[n].ndim >= 2]
    groups = {"decay": decay, "no_decay": [n for n in names if n not in decay]}
    out, ratios = {}, {}
    for group, members in groups.items():
        wb = [before[n].double() for n in members]
        wa = [after[n].double() for n in members]
        out[f"signals/weight_rms/{group}"] = math.sqrt(sum((w**2).sum().item() for w in wa) / sum(w.numel() for w in wa))
        delta = math.sqrt(sum(((a - b) ** 2).sum().item() for a, b in zip(wa, wb)))
        out[f"signals/update_rms/{group}"] = delta / math.sqrt(sum((w**2).sum().item() for w in wb))
        for n, a, b in zip(members, wa, wb):
            if b.norm() > 0:
                ratios[n] = ((a - b).norm() / b.norm()).item()
    out["signals/update_rms_max"] = max(ratios.values())
    below = total = 0
    for group in optimizer_state["param_groups"]:
        beta2, eps = group["betas"][1], group["eps"]
        for index in group["params"]:
            state = optimizer_state["state"][index]
            v_hat = state["exp_avg_sq"].double() / (1 - beta2 ** state["step"].item())
            below += (v_hat.sqrt() < eps).sum().item()
            total += v_hat.numel()
    out["signals/adam_eps_fraction"] = below / total
    return out, max(ratios, key=ratios.get)


def test_language_model_signals_equal_a_float64_recomputation(tmp_path):
    rec = Recorder()
    out = tmp_path / "run"
    train(out=out, callbacks=[rec], gradient_accumulation_steps=2,
          **tiny_lm(steps=5, log_every_num_steps=2, model_args={"n_layers": 2, "lr": 0.01}))
    rows, events = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 2, 4]
    event = next(e for e in events if e["event"] == "mechanism_signals")
    assert event["attention_modules"] == ["blocks.0.attn", "blocks.1.attn"] and event["not_measured"] == []
    for row in rows:
        step = row["step"]
        assert len(rec.batches[step]) == 2  # both microbatches of the step are in the values
        expected = float64_forward_signals(rec.before[step], rec.batches[step], n_layers=2)
        optimizer_expected, top = float64_optimizer_signals(rec.before[step], rec.after[step], rec.optimizer[step])
        expected.update(optimizer_expected)
        for key, value in expected.items():
            assert row[key] == pytest.approx(value, rel=1e-4), (step, key)
        assert event["parameters"][int(row["signals/update_rms_argmax"])] == top
        assert sorted(k for k in row if k.startswith("signals/")) == sorted(
            [*expected, "signals/update_rms_argmax"])


def _counts(tmp_path, name, extra=(), **kw):
    counter = SyncsPerStep()
    train(out=tmp_path / name, callbacks=[counter, *extra],
          **tiny_lm(steps=7, log_every_num_steps=3, checkpoint_every_num_steps=100, **kw))
    return counter.counts


def test_no_host_sync_added_on_any_step_logged_or_not(tmp_path):
    on = _counts(tmp_path, "on")
    off = _counts(tmp_path, "off", debug_args={"mechanisms": {"enabled": False}})
    assert "signals/attn_logit_max" in (tmp_path / "on" / "metrics.jsonl").read_text()
    assert "signals/" not in (tmp_path / "off" / "metrics.jsonl").read_text()
    assert on == off, (on, off)

    # Positive control: a callback that reads one of its values itself is seen, on logged steps.
    class Reads:
        def on_log_values(self, trainer, *, step, values):
            values["mine"] = torch.tensor(float(trainer.model.head.weight.detach().sum()))

    reading = _counts(tmp_path, "reading", extra=[Reads()])
    assert reading == {s: n + (s in (0, 3, 6)) for s, n in on.items()}, (reading, on)
    assert "mine" in (tmp_path / "reading" / "metrics.jsonl").read_text()


def test_image_task_says_it_has_no_attention(tmp_path, capsys):
    out = tmp_path / "cnn"
    train(out=out, model="cnn", steps=2, batch_size=8, log_every_num_steps=1, model_args={"cnn_width": 4})
    printed = capsys.readouterr().out
    line = ("Signals: no attention found in SmallCNN (no scaled_dot_product_attention call, and no softmax over the "
            "last dimension inside an attention module, in the forward pass): signals/attn_* not measured.")
    assert printed.count(line) == 1 and line in (out / "train.log").read_text()
    rows, events = read_metrics(out / "metrics.jsonl")
    event = next(e for e in events if e["event"] == "mechanism_signals")
    assert event["not_measured"] == [{"keys": "signals/attn_*", "why": line[len("Signals: "):].split(":")[0]}]
    assert event["attention_modules"] == []
    for row in rows:
        assert not any(k.startswith("signals/attn") for k in row)
        assert row["signals/output_logsumexp"] > 0 and "signals/weight_rms/decay" in row


def test_sgd_is_named_and_under_torch_compile_every_signal_is_measured(tmp_path, capsys):
    """Compiled (aot_eager: AOTAutograd's graphs, run in Python), the logged steps' forward passes run eagerly
    for the probes; the values equal an eager run's."""
    import torch._dynamo

    torch._dynamo.reset()
    rows = {}
    for compiled in (False, True):
        out = tmp_path / f"compiled{compiled}"
        train(out=out, torch_compile_args={"disable": not compiled, "backend": "aot_eager"},
              **tiny_lm(steps=3, log_every_num_steps=2, model_args={"optimizer": "sgd"}))
        rows[compiled] = read_metrics(out / "metrics.jsonl")[0]
    printed = capsys.readouterr().out
    assert "torch_compile_args" not in printed, "nothing is left unmeasured under compile"
    assert "Signals: SGD keeps no exp_avg_sq (not an Adam-family optimizer): signals/adam_eps_fraction not measured." \
        in printed
    assert [r["step"] for r in rows[True]] == [0, 2]
    for eager, compiled in zip(rows[False], rows[True]):
        keys = {k for k in eager if k.startswith("signals/")}
        assert {k for k in compiled if k.startswith("signals/")} == keys
        assert {"signals/attn_logit_max", "signals/output_logsumexp", "signals/update_rms_max"} <= keys
        for k in keys:
            assert compiled[k] == pytest.approx(eager[k], rel=1e-5, abs=1e-7), k


def test_settings_are_checked():
    settings = load_settings({"out": "o", "debug_args": {"mechanisms": {"updates": False}}})
    assert settings.debug_args.mechanisms.enabled and not settings.debug_args.mechanisms.updates
    with pytest.raises(ConfigError) as info:
        load_settings({"out": "o", "debug_args": {"mechanisms": {"enabld": True}}})
    assert "debug_args.mechanisms.enabld" in str(info.value)


def test_every_key_is_documented_on_the_mechanisms_page_and_the_loggers_page():
    page = (ROOT / "docs" / "mechanisms.md").read_text()
    documented = set(re.findall(r"^\| `(signals/[^`]+)` \|", page, re.M))
    assert documented == set(KEYS), documented ^ set(KEYS)
    assert "signals/" in (ROOT / "docs" / "loggers.md").read_text()
    assert "mechanisms.md" in (ROOT / "mkdocs.yml").read_text() and "mechanisms.md" in (
        ROOT / "docs" / "index.md").read_text()
    json.dumps(KEYS)
