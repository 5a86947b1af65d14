"""The candidate remedies: derived from the run's own settings, ordered by the mechanisms named, never
another optimizer's default (stabletrain.debug.remedies.candidates)."""

from __future__ import annotations

import pytest

from stabletrain.config import TrainSettings
from stabletrain.debug.remedies import MECHANISMS, Candidate, candidate_notes, candidates_for


def settings(**model_args):
    return {"task": "language_model", "steps": 200, "precision": "32-true", "gradient_clip_val": 0.0,
            "model_args": {"lr": 0.1, "warmup_steps": 5, "optimizer": "adamw", "eps": 1e-8, "betas": [0.9, 0.95],
                           "weight_decay": 0.0, **model_args}}


def by_name(cands: list[Candidate]) -> dict[str, Candidate]:
    return {c.name: c for c in cands}


def test_sgd_gets_its_own_lr_lowered_and_clipping_never_adamw_defaults():
    s = settings(optimizer="sgd", lr=1.0)
    cands = candidates_for(s, ["nonfinite"])
    lrs = [c.overrides["model_args.lr"] for c in cands if "model_args.lr" in c.overrides]
    assert lrs == [0.3, 0.1]  # x0.3 and x0.1 of the run's lr 1, in that order
    assert all(lr != 0.001 for lr in lrs)  # never AdamW's default
    names = [c.name for c in cands]
    assert names[:3] == ["model_args.lr=0.3", "model_args.lr=0.1", "gradient_clip_val=1"]
    assert not any({"model_args.eps", "model_args.betas"} & set(c.overrides) for c in cands)  # Adam's: not SGD's
    assert all(c.mechanisms == ("nonfinite",) for c in cands[:3]) and "against a non-finite step" in cands[0].why
    assert not candidate_notes(s, ["nonfinite"])  # SGD: clipping is a candidate, nothing left out


def test_adamw_is_not_offered_clipping_and_says_why():
    s = settings()
    names = [c.name for c in candidates_for(s, ["runaway_updates"])]
    assert not any(n.startswith("gradient_clip_val") for n in names)
    (note,) = candidate_notes(s, ["runaway_updates"])
    assert note.startswith("gradient clipping is not a candidate: AdamW's update is about lr in size")
    assert names[:3] == ["model_args.lr=0.03", "model_args.lr=0.01", "model_args.warmup_steps=20"]


def test_clipping_already_on_is_halved():
    s = {**settings(optimizer="sgd"), "gradient_clip_val": 3.0}
    (clip,) = [c for c in candidates_for(s) if "gradient_clip_val" in c.overrides]
    assert clip.overrides == {"gradient_clip_val": 1.5} and "was 3" in clip.why


@pytest.mark.parametrize("mechanism, first", [
    ("attention_logit_growth", "model_args.qk_norm=true"),
    ("adam_eps", "model_args.eps=1e-08"),
    ("output_logit_divergence", "model_args.z_loss=0.0001"),
    ("stale_second_moment", "model_args.betas=[0.9, 0.9]"),
    ("runaway_updates", "model_args.lr=0.03"),
])
def test_the_named_mechanism_puts_its_published_fix_first(mechanism, first):
    cands = candidates_for(settings(eps=1.0), [mechanism])
    assert cands[0].name == first and cands[0].mechanisms == (mechanism,)
    assert len({c.name for c in cands}) == len(cands)  # each candidate once


def test_eps_is_lowered_from_the_runs_own_value():
    assert by_name(candidates_for(settings(eps=1.0)))["model_args.eps=1e-08"].overrides == {"model_args.eps": 1e-8}
    small = [c for c in candidates_for(settings(eps=1e-8), ["adam_eps"]) if "model_args.eps" in c.overrides]
    assert [c.overrides["model_args.eps"] for c in small] == [1e-10]  # already the default: 100x lower


def test_beta2_above_095_goes_to_095():
    (beta,) = [c for c in candidates_for(settings(betas=[0.9, 0.999])) if "model_args.betas" in c.overrides]
    assert beta.overrides == {"model_args.betas": [0.9, 0.95]}


def test_weight_decay_only_for_output_logit_divergence():
    assert not any("weight_decay" in c.name for c in candidates_for(settings()))
    names = [c.name for c in candidates_for(settings(), ["output_logit_divergence"])]
    assert names[:3] == ["model_args.z_loss=0.0001", "model_args.weight_decay=0.1", "model_args.lr=0.03"]


def test_precision_widens_only_from_a_reduced_one():
    assert not any(c.name.startswith("precision") for c in candidates_for(settings()))
    fp16 = candidates_for({**settings(), "precision": "16-mixed"}, ["fp16_range"])
    assert fp16[0].name == "precision=bf16-mixed"
    bf16 = candidates_for({**settings(), "precision": "bf16-mixed"})
    assert [c.name for c in bf16 if c.name.startswith("precision")] == ["precision=32-true"]


def test_qk_norm_is_tried_from_step_0_and_warmup_only_while_it_lasts():
    cands = by_name(candidates_for(settings()))
    qk = cands["model_args.qk_norm=true"]
    assert qk.from_start and qk.starts_at(50) == 0 and "from step 0" in qk.why
    warmup = cands["model_args.warmup_steps=20"]
    assert warmup.starts_at(10) == 10 and warmup.starts_at(20) == 0  # past the longer warmup: from step 0
    assert cands["model_args.lr=0.03"].starts_at(50) == 50


def test_model_options_only_for_the_built_in_language_model_and_only_when_off():
    image = {**settings(), "task": "image_classification"}
    assert not any("qk_norm" in c.name or "z_loss" in c.name for c in candidates_for(image))
    on = candidates_for(settings(qk_norm=True, z_loss=1e-4))
    assert not any("qk_norm" in c.name or "z_loss" in c.name for c in on)


def test_bad_data_has_no_setting_and_says_so():
    cands = candidates_for(settings(), ["bad_data"])
    assert all(not c.mechanisms for c in cands)  # no candidate answers it
    assert any(n.startswith("bad data: no setting fixes it") for n in candidate_notes(settings(), ["bad_data"]))


def test_unknown_mechanism_lists_the_known_ones():
    with pytest.raises(ValueError) as err:
        candidates_for(settings(), ["attention_growth"])
    assert "'attention_growth'" in str(err.value) and all(m in str(err.value) for m in MECHANISMS)


def test_train_settings_are_accepted_too():
    s = TrainSettings(out="o", steps=100, model_args={"optimizer": "sgd", "lr": 2.0})
    assert [c.name for c in candidates_for(s)][:2] == ["model_args.lr=0.6", "model_args.lr=0.2"]


def test_slugs_are_folder_names():
    names = {c.slug for c in candidates_for(settings(betas=[0.9, 0.999]))}
    assert "lr=0.03" in names and "betas=_0.9_0.95" in names and "qk_norm=true" in names
    assert all("/" not in n and " " not in n for n in names)
