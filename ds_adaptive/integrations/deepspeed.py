"""DeepSpeed integration, shipped as ``ds_adaptive.integrations.deepspeed``: registers ds_adaptive's op builder
(``LNModulateBuilder``) in DeepSpeed's op registry, and nothing else. The machinery is
``ds_adaptive.ops.registry`` (the core never imports ``patches``); the model's op switch is
``ds_adaptive.ops.apply_ln_modulate``, decided by the run configuration.

    from ds_adaptive.integrations.deepspeed import register_ops
    register_ops()      # get_accelerator().create_op_builder("LNModulateBuilder") works afterwards
"""
from ds_adaptive.ops.registry import builder, is_registered, op_report, register_ops, unregister_ops

__all__ = ["register_ops", "unregister_ops", "is_registered", "op_report", "builder"]
