"""The double's `qai_hub.public_rest_api`: where qai-hub 0.56.0 defines ClientConfig."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_HUB_API_URL = "https://workbench.aihub.qualcomm.com"
DEFAULT_HUB_WEB_URL = "https://workbench.aihub.qualcomm.com"


@dataclass
class ClientConfig:
    api_token: str
    api_url: str = DEFAULT_HUB_API_URL
    web_url: str = DEFAULT_HUB_WEB_URL
    verbose: bool = False
    client_mode: str = "library"
    default_project: str | None = None
