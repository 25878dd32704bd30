"""Where a model's config.json lives, for a model named as users name it: a local directory or
a Hugging Face hub ID (`z-lab/Qwen3-8B-DFlash-b16`), resolved as SGLang and transformers
resolve it: the local path first, else the hub cache (HF_HOME / HF_HUB_CACHE, or
--download-dir), at the given revision, with HF_HUB_OFFLINE honoured.  Only config.json is
fetched here when online; the weights are SGLang's to download.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def fetch_hint(ref: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """How to fetch `ref` into the cache the server reads (the revision and cache it asked for)."""
    command = f"hf download {ref}" + (f" --revision {revision}" if revision else "") + (
        f" --cache-dir {cache_dir}" if cache_dir else "")
    return f"fetch it ahead of time with `{command}` (huggingface_hub's CLI), or pass a local " \
           "directory"



class ModelNotFound(ValueError):
    """A model reference that is neither a local directory nor a resolvable hub repo."""


def is_hub_id(ref: str) -> bool:
    """`owner/name` or `name`, not a filesystem path (no leading ./ or /, no ~)."""
    return bool(HUB_ID.match(ref)) and not ref.startswith((".", "/", "~"))


def names_hub_repo(ref: str) -> bool:
    """`ref` is read from the hub: a repo id with no local path of that name (a local path
    always wins, as in SGLang and transformers)."""
    return is_hub_id(ref) and not Path(ref).expanduser().exists()


def model_dir(ref: str, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """The directory holding `ref`'s config.json: `ref` itself when it exists locally, else
    the hub cache's snapshot of the repo `ref` (config.json downloaded unless offline)."""
    path = Path(ref).expanduser()
    if path.exists():
        return path
    if not is_hub_id(ref):
        raise ModelNotFound(f"{ref!r} is neither a local directory nor a Hugging Face repo id "
                            "(owner/name)")
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, HfHubHTTPError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    where = f"revision {revision!r}" if revision else "its default revision"
    try:
        return Path(hf_hub_download(ref, "config.json", revision=revision,
                                    cache_dir=cache_dir)).parent
    except LocalEntryNotFoundError:
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        raise ModelNotFound(
            f"{ref!r} is not a local directory, and its config.json at {where} is not in the "
            f"Hugging Face cache {cache_dir or constants.HF_HUB_CACHE}{offline}; "
            + fetch_hint(ref, revision, cache_dir)) from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ModelNotFound(f"{ref!r} at {where}: no such repo or revision on the Hugging Face "
                            f"hub ({type(exc).__name__})") from None
    except EntryNotFoundError:
        raise ModelNotFound(f"{ref!r} at {where} has no config.json") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelNotFound(f"{ref!r}: could not read its config.json from the Hugging Face hub "
                            f"({type(exc).__name__}: {str(exc)[:200]}); "
                            + fetch_hint(ref, revision, cache_dir)) from None
