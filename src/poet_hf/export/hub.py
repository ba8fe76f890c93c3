"""Pushing an export to the Hugging Face Hub with ``huggingface_hub``."""

from __future__ import annotations

import os
from pathlib import Path

from .source import first_line


class HubPushError(RuntimeError):
    """Pushing an exported folder to the Hub failed (no token, no network, refused by the Hub)."""


def push_merged_to_hub(
    output_dir: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    endpoint: str | None = None,
) -> str:
    """Upload an export of [`export_merged`][poet_hf.export.export_merged] to the Hub model repo ``repo_id``.

    Returns the commit URL.

    Uses ``huggingface_hub`` (``create_repo(exist_ok=True)`` then ``upload_folder``). The token is ``token``, else
    ``HF_TOKEN``, else the one saved by ``hf auth login``; the endpoint is ``endpoint``, else ``HF_ENDPOINT``.
    The folder on disk is only read. Errors are raised as [`HubPushError`][poet_hf.export.HubPushError] with a readable
    message.

    Args:
        output_dir: the export folder.
        repo_id: the model repo (``user/name`` or ``org/name``); created if missing.
        private: create the repo private.
        token: the Hub token (default ``HF_TOKEN``, else ``hf auth login``'s).
        commit_message: the commit message.
        revision: the branch to commit to.
        endpoint: another Hub instance (default ``HF_ENDPOINT``).

    Returns:
        The commit URL.

    Raises:
        HubPushError: no token, no network, a repo the token cannot write to, a refused upload, or a folder that is not
            an export.
    """
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    folder = Path(output_dir)
    _check_export_folder(folder)
    token = token or get_token()
    if not token:
        raise HubPushError(
            f"no Hugging Face token to push {folder} to '{repo_id}': pass --hub_token / token=..., "
            "set HF_TOKEN, or run `hf auth login`"
        )
    # HF_ENDPOINT read now, not when huggingface_hub was imported (it fixes its default then)
    api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT"), token=token)
    where = f"'{repo_id}' at {api.endpoint}"
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            repo_type="model",
            revision=revision,
            commit_message=commit_message or "Upload POET export (poet_hf)",
        )
    except RepositoryNotFoundError as error:
        raise HubPushError(
            f"the Hub has no model repo {where} that this token can write to (does the name belong "
            f"to a dataset or Space, or to another account?): {first_line(error)}"
        ) from error
    except HfHubHTTPError as error:
        raise HubPushError(f"the Hub refused pushing {folder} to {where}: {first_line(error)}") from error
    except (OSError, ValueError) as error:
        raise HubPushError(
            f"could not push {folder} to {where}: {type(error).__name__}: {first_line(error)}"
        ) from error
    except Exception as error:  # httpx transport errors (connection refused, DNS, timeouts)
        raise HubPushError(
            f"could not reach the Hub to push {folder} to {where}: {type(error).__name__}: {first_line(error)}"
        ) from error
    return str(info.commit_url)


def _check_export_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise HubPushError(f"{folder} is not a directory; export a model with export_merged first")
    names = {p.name for p in folder.iterdir()}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise HubPushError(
            f"{folder} does not look like an export (needs config.json and *.safetensors, found "
            f"{', '.join(sorted(names)) or 'nothing'})"
        )
