"""Model families behind one seam (``family.py``, docs/ARCHITECTURE.md "The model seam").

``registry.get_model(name)`` -> a :class:`family.Model`: config, builder, token-grid rule, text length,
FLOPs, weight adapter, objective options. The rest of the package asks it and never imports a family's
module. Families: ``wan21`` (Wan 2.1 T2V); the Wan-architecture code is ``wan`` (the DiT, diffusers'
numerics), ``weights`` (diffusers / original checkpoints), ``flops``; ``testing`` holds test helpers.
"""
from ds_adaptive.models.family import (DiffusionTransformer, MediaDefaults, Model, ModelError, ModelFamily,  # noqa: F401
                     ObjectiveOptions, Preset, WeightAdapter)
from ds_adaptive.models.registry import default_model, families, get_model, model_names  # noqa: F401
