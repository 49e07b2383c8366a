"""The Jupyter UI of Partition Explorer (ipywidgets + bokeh).

Every number it shows comes from ``explorer``; it computes nothing of its own.
"""
