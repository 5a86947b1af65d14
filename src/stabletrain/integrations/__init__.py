"""stabletrain's tools inside the trainers people already use.

One line each, no switch of trainer::

    # PyTorch Lightning (pip install "stabletrain[lightning]")
    from stabletrain.integrations.lightning import StabletrainCallback
    trainer = lightning.pytorch.Trainer(callbacks=[StabletrainCallback(debug_args={"nancapture": {"enabled": True}})])

    # Hugging Face Trainer (pip install "stabletrain[transformers]")
    from stabletrain.integrations.transformers import StabletrainCallback
    callback = StabletrainCallback(debug_args={"nancapture": {"enabled": True}})
    trainer = transformers.Trainer(model, args, callbacks=[callback])

    # Accelerate loops (pip install "stabletrain[accelerate]")
    from stabletrain.integrations.accelerate import StepMonitor
    monitor = StepMonitor(accelerator, model, out_dir="out/run", debug_args={"nancapture": {"enabled": True}})

Each runs the plain-loop tools (gradient norm, ``underflow_overflow``, ``nancapture`` with
offline replay and ``stabletrain diagnose``, trend alerts) at the framework's own points of
a step; ``common.StepTools`` holds what they share. The submodules import their framework,
this package imports nothing.
"""
