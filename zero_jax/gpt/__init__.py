"""The demo application: a byte-level GPT, its data, its YAML config and the experiment
builder that turns a config into a plan and a train step.

It is a *user* of the library, written only against ``zero_jax``'s public modules; nothing in
the library imports it (``tests/test_style.py`` checks).
"""
