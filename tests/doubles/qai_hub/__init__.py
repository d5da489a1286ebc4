"""A stand-in for the `qai_hub` client (qai-hub 0.56.0) with no network.

The same public names the compile stage uses, with qai-hub 0.56.0's signatures: Client,
ClientConfig, Device, Model, CompileJob, LinkJob, JobStatus (with its State enum and properties),
Error, UserError, InternalError, and RateLimitedError in `qai_hub.client` only. The "server" is a JSON file in
$FAKE_QAI_HUB_STATE (created on first use), so jobs outlive a killed client process.
$FAKE_QAI_HUB_SCENARIO names a JSON file that says how the server behaves:

  valid_tokens: tokens that pass ([]: any token); a client.ini is read from QAIHUB_CLIENT_INI
  devices: [{name, attributes, soc, arch}]: what get_devices returns
  polls_to_finish: get_status calls a job stays running before it finishes (default 1)
  fail: {job name: [messages]}: that job's first submissions fail with these messages, in turn
  rate_limit / internal_error: {method: n}: the first n calls of that method raise the error
  no_network: true: every call raises InternalError as the real client does without a connection
  quota_exceeded: true: submissions raise UserError about the quota

A finished compile job's target model is a file that carries the uploaded graph's I/O tensor names
and the device's `soc_type=...;arch=...` string, as real context binaries do.
"""

# The layout of the real package (qai-hub 0.56.0): classes and exceptions in .client, ClientConfig in
# .public_rest_api, module-level calls in .hub; the top level re-exports both `__all__` lists only.
from ._version import __version__  # noqa: F401
from .client import *  # noqa: F401,F403
from .client import __all__ as __client_all__
from .hub import *  # noqa: F401,F403
from .hub import __all__ as __hub_all__

__all__ = __hub_all__ + __client_all__ + ["__version__"]
