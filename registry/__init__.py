"""The control plane: the registry of base models, adapter versions, tenants, bindings and
the audit log (``models``, ``service``), adapter admission (``admission``), change fan-out
and the reader-side snapshot cache (``changes``, ``cache``), the admin API (``admin_api``)
and the ``loraplex migrate`` / ``loraplex admin`` commands (``cli``)."""
