"""Every field of vLLM's OpenAI-server request models, read from vLLM's own source (no vLLM
import: the classes' annotated attributes, by `ast`). Writes the checked-in list that
tests/test_request_fields.py walks.

Regenerate from a vLLM release (the wheel holds the source; `--no-deps` fetches nothing else):

    d=$(mktemp -d)
    pip download vllm==0.33.0 --no-deps -d "$d"
    unzip -q "$d"/vllm-*.whl 'vllm/*' -d "$d"
    python -m tests.vllm_request_fields "$d" > tests/vllm_request_fields.json
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

# (file under the vLLM source root, request model classes in it)
MODELS = {
    "vllm/entrypoints/openai/chat_completion/protocol.py": ["ChatCompletionRequest"],
    "vllm/entrypoints/openai/completion/protocol.py": ["CompletionRequest"],
    "vllm/entrypoints/serve/tokenize/protocol.py": [
        "TokenizeCompletionRequest",
        "TokenizeChatRequest",
        "DetokenizeRequest",
    ],
}


def class_fields(source: str, name: str) -> list[str]:
    """The pydantic fields a class body declares: annotated names, less private ones and
    ClassVars."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [
                stmt.target.id
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and not stmt.target.id.startswith("_")
                and "ClassVar" not in ast.unparse(stmt.annotation)
            ]
    raise SystemExit(f"class {name} not found")


def read(root: Path) -> dict[str, object]:
    version = {}
    exec((root / "vllm/_version.py").read_text(), version)  # noqa: S102 - vLLM's own file
    models = {
        name: class_fields((root / path).read_text(), name)
        for path, names in MODELS.items()
        for name in names
    }
    return {
        "vllm_version": version["__version__"],
        "vllm_commit": version.get("__commit_id__"),
        "files": sorted(MODELS),
        "models": models,
    }


if __name__ == "__main__":
    print(json.dumps(read(Path(sys.argv[1])), indent=1))
