"""Platform webhooks as plain functions: per platform, `check_headers`
(before the body is read) and `parse_webhook(headers, body, secret, now)`
(the signature, then the payload) give the messages to turn into turns
(`Inbound`), an answer that needs no turn (`Answer`: a challenge, a PONG, an
acknowledged update with no text) or a refusal (`Refusal`: a 4xx and a
one-line reason); `answer` shapes the reply once the turns are enqueued.
No server and no SDK at import (PyNaCl is imported where Discord verifies):
workers/web.py routes, caps the body, de-dups and enqueues."""

from adapters.platforms.webhooks.base import MAX_CLOCK_SKEW_S, Answer, Inbound, Refusal

__all__ = ["MAX_CLOCK_SKEW_S", "Answer", "Inbound", "Refusal"]
