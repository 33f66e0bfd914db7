"""Container health check: exits 0 when the service in this container answers ``GET /readyz`` with 200.

Used by the image's HEALTHCHECK and docker-compose (``depends_on: condition: service_healthy``). Stdlib only: the
slim base images carry no curl. Kubernetes does not use it (the chart has its own HTTP probes).
"""

import os
import ssl
import sys
import urllib.request


def main() -> int:
    port = os.environ.get("RLHF_HTTP_PORT", "8000")
    context = None
    scheme = "http"
    if os.environ.get("RLHF_TLS_CERT"):
        # Loopback call to ourselves: the certificate names the service, not 127.0.0.1, so it is not verified here.
        scheme = "https"
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    url = f"{scheme}://127.0.0.1:{port}/readyz"
    try:
        with urllib.request.urlopen(url, timeout=4, context=context) as response:
            return 0 if response.status == 200 else 1
    except Exception as err:  # noqa: BLE001 - any failure means "not ready"; say why in `docker inspect`
        print(f"{url}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
