"""The Realtime websocket transport: ``duplex-actors serve`` (extra ``server``).

:class:`RealtimeServer` puts a :class:`~duplex_actors.Runtime` on ``/v1/realtime`` in the
OpenAI Realtime event vocabulary plus duplex extensions; :mod:`.wire` is the codec,
:mod:`.metrics` the Prometheus side. See docs/protocol.md for every event.
"""

from .app import RealtimeServer, ServerConfig
from .wire import WireLimits

__all__ = ["RealtimeServer", "ServerConfig", "WireLimits"]
