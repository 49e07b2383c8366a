"""The Jupyter UI of Partition Explorer (ipywidgets + bokeh through jupyter_bokeh).

    from widgets import Explorer
    Explorer(model, example_inputs, cluster=ex.Cluster.cpu(2))   # or Explorer(graph, costs, plan)
    Explorer.builtin("gpt", size="small", devices="cpu:2")

Every number it shows comes from ``explorer``; it computes nothing of its own.
:class:`Session` is the same state without any drawing (edits, pins, undo/redo, estimates).
"""

from widgets.session import PlanEntry, Session


def __getattr__(name: str):
    # the drawing part needs the notebook extras (ipywidgets, bokeh, jupyter_bokeh)
    if name == "Explorer":
        try:
            from widgets.app import Explorer
        except ImportError as e:
            raise ImportError(f"the explorer widget needs the notebook extras ({e.name} is "
                              "missing): pip install 'partition-explorer[notebook]'") from None
        return Explorer
    raise AttributeError(name)


__all__ = ["Explorer", "PlanEntry", "Session"]
