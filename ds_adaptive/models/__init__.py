"""Models: the Wan 2.1 DiT (``wan``) and its checkpoint loading (``weights``)."""
from .wan import (WAN_CONFIGS, WanConfig, WanConfigError, WanInputs, WanModel, count_parameters,  # noqa: F401
                  get_wan_config, sdpa_attention)
from .weights import WanWeightsError, load_wan_weights, save_wan_weights  # noqa: F401
