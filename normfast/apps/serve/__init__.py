"""``normfast serve``: a local web service over a :class:`~normfast.engine.prober.Prober` -- a JSON
API that probes texts (:mod:`.protocol`: the requests, the answers, the limits) and an interactive
page built from the run page's code (:mod:`.app`), started by the command (:mod:`.command`).

Needs the ``serve`` extra (``pip install "normfast[serve]"``: fastapi and uvicorn), imported only
when the service starts."""
