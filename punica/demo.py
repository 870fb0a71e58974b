"""The demo LoRA adapters shipped with punica for the embedded default model (SmolLM2-135M-Instruct).

They are made by scripts/train_demo_adapters.py; each has an effect one can see in a chat reply:
    signature   ends every reply with the line SIGNATURE
    json        replies as a JSON object {"answer": "..."}
    pirate      opens every reply with PIRATE_GREETING
"""

from __future__ import annotations

from pathlib import Path

DEMO_ADAPTER_DIR = Path(__file__).parent / "demo_adapters"
DEMO_ADAPTER_NAMES = ("signature", "json", "pirate")
SIGNATURE = "-- sent by punica"
PIRATE_GREETING = "Arr, matey!"


def demo_adapters() -> dict[str, str]:
    """Name -> installed PEFT directory of each demo adapter, in DEMO_ADAPTER_NAMES order."""
    paths = {name: DEMO_ADAPTER_DIR / name for name in DEMO_ADAPTER_NAMES}
    missing = [str(path) for path in paths.values() if not (path / "adapter_config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"demo adapters missing (run scripts/train_demo_adapters.py): {', '.join(missing)}")
    return {name: str(path) for name, path in paths.items()}
