"""The views' colours, as JupyterLab's theme variables: every HTML view (the one-shot dashboard and its bars,
the pool's view and its histories, a pool cell's line, ``%ddp who``/``%ddp diff``) reads in a light theme and
a dark one alike, and follows a theme switched while it is shown.

Text keeps the front end's own colour; a state's colour is JupyterLab's brand, success, error or warning
colour of the theme shown; boxes and a bar's empty part are its layout and border greys. Each has a
fallback for front ends without JupyterLab's variables (VS Code, Colab, nbviewer): a mid-tone that reads on
a white page and on a dark one, greys half transparent so they darken a light page and lighten a dark one.
The text forms (``text/plain``) carry no colour at all.
"""
from __future__ import annotations

TEXT = "var(--jp-ui-font-color1, inherit)"  # text a little quieter than the output's own (the pool's cells)
MUTED = "var(--jp-ui-font-color2, #808080)"  # headers, the logs line, a pool cell's line
RUNNING = "var(--jp-brand-color1, #1e88e5)"
DONE = "var(--jp-success-color1, #43a047)"
FAILED = "var(--jp-error-color1, #e53935)"
WARN = "var(--jp-warn-color0, #ef6c00)"  # stopped, interrupted, a bar that ended short (color1 is too pale on white)
BOX = "var(--jp-layout-color2, rgba(128, 128, 128, 0.15))"  # a history's box
TRACK = "var(--jp-border-color2, rgba(128, 128, 128, 0.3))"  # a bar's empty part

STATES = {"starting": MUTED, "running": RUNNING, "finished": DONE, "failed": FAILED, "stopped": WARN,
          "interrupted": WARN, "in debugger": WARN}
# a chart's lines, one per rank (views/metrics_chart.py): mid-tones that read on a white page and on a dark one
SERIES = ("#1e88e5", "#f4511e", "#43a047", "#d81b60", "#8e24aa", "#00897b", "#fb8c00", "#6d4c41")
