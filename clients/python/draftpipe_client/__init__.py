"""Send a target model's hidden states to a running ``draftpipe run`` whose target stage has
``source = stream(listen = ...)``.

>>> from draftpipe_client import Producer
>>> with Producer("127.0.0.1:7070", hidden=4096, tap_layers=[2, 10, 18, 26, 34], vocab=151936) as p:
...     p.send(input_ids=ids, hidden_states=hs, loss_mask=mask)   # doctest: +SKIP

Each :meth:`Producer.send` is acknowledged only when draftpipe has queued every batch it made, so a full
queue slows the producer down (backpressure). Sequences may have any length: draftpipe buckets and pads them.
"""

from ._producer import PROTOCOL_VERSION, Ack, DraftpipeError, Producer, ProducerError, ProducerTimeout, RunEnded

__all__ = ["Ack", "DraftpipeError", "PROTOCOL_VERSION", "Producer", "ProducerError", "ProducerTimeout", "RunEnded"]
#: The package's one version number: ``pyproject.toml`` reads it (``[tool.setuptools.dynamic]``).
__version__ = "0.1.0"
