"""Measuring on a GPU and fitting: ``calibrate`` (the model -> a cost / memory profile), ``sparse`` (the
block-sparse kernel vs density), ``selection_timing``, ``autocalibrate`` (first-use self-calibration), ``refit``
(a profile refitted to the trainer's own compute windows).
"""
