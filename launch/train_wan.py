#!/usr/bin/env python
"""Entry point for the DeepSpeed launcher:

    deepspeed launch/train_wan.py --deepspeed_config launch/configs/zero3_adaptive.json [trainer args]

Same as ``ds-adaptive train``; ``python launch/train_wan.py --help`` lists the arguments.
"""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "ds_adaptive")):  # run from a checkout: use its code
    sys.path.insert(0, _ROOT)

from ds_adaptive.launch.supervise import die_with_parent  # noqa: E402

if __name__ == "__main__":
    # A rank whose launcher is SIGKILLed gets SIGTERM instead of training on as an orphan.
    die_with_parent()
    from ds_adaptive.cli.train import run

    run()
