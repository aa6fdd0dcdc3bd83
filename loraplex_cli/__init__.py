"""The composition root: the ``loraplex`` command and the embedded runner, above every package.

Only this package imports gateway, registry and engine together; ``loraplex/`` (the shared
ground floor) imports none of them.
"""
