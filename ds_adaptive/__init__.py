"""ds_adaptive: AdaptiveLoad for DeepSpeed / Megatron video diffusion transformer training.

The package is layered (docs/ARCHITECTURE.md): core <- ops / models / parallel / attention <- data / media /
preprocess <- planning <- calibration / simulation <- training <- inference <- integrations <- launch <- cli.
"""
from ds_adaptive import _compat

__version__ = "0.1.0"

_compat.install()
