"""TLS for ``serve --tls-cert PATH --tls-key PATH``: wss:// and https:// on the same port.

Browsers on https pages may only open ``wss://`` sockets, and the Node ``openai`` SDK's
realtime client always connects with ``wss://``, so a server people can reach needs TLS. The
context is the standard library's server default (TLS 1.2+, the system's cipher choice).
"""

from __future__ import annotations

import ssl


def server_ssl_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """A server context for a PEM certificate chain and key; None when neither is given."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both a certificate (tls_cert) and its private key (tls_key)")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context
