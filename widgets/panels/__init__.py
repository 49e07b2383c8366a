"""The explorer widget's panels: each draws one part of a :class:`widgets.session.Session`.

Every panel takes the session, builds its ipywidgets/bokeh controls once, forwards its controls
to the session's methods and redraws from the session's current objects in ``update(what)``
when the session reports a change it shows (``topics``). :class:`widgets.app.Explorer` lays the
panels out and routes the session's changes to them.
"""
