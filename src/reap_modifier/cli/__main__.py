"""``python -m reap_modifier.cli``: the ``reap`` command."""

from . import app

app()
