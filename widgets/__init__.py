"""The Jupyter UI of Partition Explorer (ipywidgets + bokeh); every number comes from ``explorer``."""
