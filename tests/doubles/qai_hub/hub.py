"""The double's `qai_hub.hub`: module-level calls on a default client, as in qai-hub 0.56.0."""

from .client import Client as _Client

__all__ = ["get_devices", "upload_model", "get_model", "submit_compile_job", "submit_link_job", "get_job"]

_global_client = _Client()
get_devices = _global_client.get_devices
upload_model = _global_client.upload_model
get_model = _global_client.get_model
submit_compile_job = _global_client.submit_compile_job
submit_link_job = _global_client.submit_link_job
get_job = _global_client.get_job
