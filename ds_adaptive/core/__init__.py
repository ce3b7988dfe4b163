"""Foundations every layer may use: the ``adaptive_load`` config schema, the (DP x SP) layout and its rules,
video shapes -> tokens, small file and port helpers. Imports nothing else of ds_adaptive.
"""
