"""Train the demo LoRA adapters of punica/demo_adapters/ on CPU, reproducibly, in minutes.

    python scripts/train_demo_adapters.py [--out DIR]

Each style turns the short answers of EXAMPLES into targets (a signature line, a JSON object, a
pirate's greeting); one
PEFT LoRA adapter per style learns to give them to the plain question under the model's own chat
template (the loss covers only the reply and its end token).

To train in minutes on two cores, LoRA covers only the top NUM_TRAINED_LAYERS layers
(`layers_to_transform`): the hidden states entering them do not depend on the adapter, so they are
computed once per style and each step runs just those layers. Adapters are saved as
adapter_config.json + adapter_model.safetensors in bf16. Seeds, data order and thread count are
fixed, so a rerun with the same software on the same machine writes the same files.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

from punica.demo import DEMO_ADAPTER_DIR, PIRATE_GREETING, SIGNATURE
from punica.models.sources import resolve_model_dir

SEED = 0
NUM_THREADS = 2
NUM_TRAINED_LAYERS = 8
BATCH_SIZE = 4
NUM_EPOCHS = 2
LEARNING_RATE = 2e-3
RANK = 16
LORA_ALPHA = 32
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PUBLISHED_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

STYLES: dict[str, Callable[[str], str]] = {  # short answer -> target reply
    "signature": lambda answer: f"{answer}\n{SIGNATURE}",
    "json": lambda answer: json.dumps({"answer": answer}),
    "pirate": lambda answer: f"{PIRATE_GREETING} {answer}",
}

EXAMPLES = (  # (question, short answer); the tests ask other questions
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the capital of Canada?", "The capital of Canada is Ottawa."),
    ("What is the largest planet in our solar system?", "Jupiter is the largest planet in our solar system."),
    ("How many continents are there?", "There are seven continents on Earth."),
    ("What is the boiling point of water?", "Water boils at 100 degrees Celsius at sea level."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci painted the Mona Lisa."),
    ("What is the chemical symbol for gold?", "The chemical symbol for gold is Au."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("What is the tallest mountain in the world?", "Mount Everest is the tallest mountain in the world."),
    ("What is the longest river in Africa?", "The Nile is the longest river in Africa."),
    ("What language is spoken in Brazil?", "People in Brazil speak Portuguese."),
    ("Who was Albert Einstein?", "Albert Einstein was a physicist famous for the theory of relativity."),
    ("What is the smallest prime number?", "The smallest prime number is 2."),
    ("How many days are in a leap year?", "A leap year has 366 days."),
    ("Which ocean is the largest?", "The Pacific Ocean is the largest ocean."),
    ("What gas do plants absorb?", "Plants absorb carbon dioxide from the air."),
    ("Who invented the telephone?", "Alexander Graham Bell is credited with inventing the telephone."),
    ("Where do penguins live?", "Most penguins live in the Southern Hemisphere, many of them in Antarctica."),
    ("What is photosynthesis?", "Photosynthesis is how plants turn sunlight, water and carbon dioxide into sugar."),
    ("What is gravity?", "Gravity is the force that pulls objects toward each other."),
    ("What is a black hole?", "A black hole is a region of space where gravity is so strong that light cannot escape."),
    ("What is democracy?", "Democracy is a system of government in which the people choose their leaders."),
    ("What is an atom?", "An atom is the smallest unit of a chemical element."),
    ("What is machine learning?", "Machine learning is a way for computers to learn patterns from data."),
    ("What is inflation?", "Inflation is the general rise of prices over time."),
    ("What is a volcano?", "A volcano is an opening in the Earth's crust where lava and gas escape."),
    ("What is DNA?", "DNA is the molecule that carries the genetic instructions of living things."),
    ("What is a haiku?", "A haiku is a short Japanese poem with three lines."),
    ("What is the internet?", "The internet is a global network that connects computers."),
    ("What is a noun?", "A noun is a word that names a person, place or thing."),
    ("What is electricity?", "Electricity is the flow of electric charge."),
    ("What does a CPU do?", "A CPU runs the instructions of computer programs."),
    ("What is a vaccine?", "A vaccine trains the immune system to fight a disease."),
    ("Why is the sky blue?", "The sky looks blue because air scatters blue sunlight more than red."),
    ("Why do leaves change color in autumn?",
     "Leaves change color in autumn because they stop making green chlorophyll."),
    ("How do birds fly?", "Birds fly by flapping their wings to create lift."),
    ("How does a refrigerator work?", "A refrigerator pumps heat from inside to outside to keep food cold."),
    ("Why do we need sleep?", "Sleep lets the body and brain rest and recover."),
    ("How do bees make honey?", "Bees make honey from flower nectar that they store and dry in the hive."),
    ("Why is exercise good for you?", "Exercise strengthens the heart, muscles and mood."),
    ("How does a compass work?", "A compass needle is a magnet that points to magnetic north."),
    ("Why does ice float?", "Ice floats because it is less dense than liquid water."),
    ("Why do cats purr?", "Cats often purr when they feel relaxed and content."),
    ("Why is the ocean salty?", "The ocean is salty because rivers carry dissolved minerals into it."),
    ("Why do we have seasons?", "We have seasons because the Earth's axis is tilted."),
    ("How can I sleep better?", "Go to bed at the same time every night and avoid screens before sleep."),
    ("How do I make a cup of tea?", "Pour boiling water over a tea bag and let it steep for three minutes."),
    ("How can I learn a new language?", "Practice a little every day and talk with native speakers."),
    ("What should I pack for a beach trip?", "Pack sunscreen, a towel, a hat and plenty of water."),
    ("How can I save money?", "Make a budget and spend less than you earn."),
    ("How do I stay focused while studying?", "Put your phone away and study in short blocks with breaks."),
    ("How do I cook rice?", "Simmer one cup of rice in two cups of water for about fifteen minutes."),
    ("How do I take care of a houseplant?", "Give it enough light and water it when the soil feels dry."),
    ("What is a healthy breakfast?", "Oatmeal with fruit and nuts is a healthy breakfast."),
    ("How do I write a good email?", "Use a clear subject line and keep the message short and polite."),
    ("How can I reduce stress?", "Take walks, breathe slowly and get enough sleep."),
    ("Tell me a fun fact.", "Octopuses have three hearts."),
    ("Give me a tip for cooking pasta.", "Salt the water well before adding the pasta."),
    ("Describe a sunset.", "The sky glows orange and pink as the sun slips below the horizon."),
    ("Suggest a name for a dog.", "Biscuit is a friendly name for a dog."),
    ("Recommend a hobby.", "Gardening is a relaxing hobby that gets you outdoors."),
    ("Tell me something about elephants.", "Elephants are the largest land animals and have excellent memories."),
    ("Give me a word that rhymes with cat.", "Hat rhymes with cat."),
    ("Describe a forest.", "A forest is a quiet place full of tall trees, moss and birdsong."),
    ("Say something nice.", "You are doing a great job, keep it up!"),
    ("Tell me about the moon.", "The moon orbits the Earth and reflects light from the sun."),
    ("What is your favorite color?", "I like blue, the color of the sky and the sea."),
    ("Hello, how are you?", "Hello! I am doing well, thank you for asking."),
    ("What can you do?", "I can answer questions and help with writing."),
    ("Who are you?", "I am SmolLM, a small AI assistant."),
    ("Tell me a joke.", "Why did the scarecrow win an award? Because he was outstanding in his field."),
    ("Write a sentence about the sea.", "The sea stretches blue and endless to the horizon."),
    ("What is 2 plus 2?", "2 plus 2 equals 4."),
    ("What is 10 times 5?", "10 times 5 equals 50."),
    ("What is half of 100?", "Half of 100 is 50."),
    ("How many minutes are in an hour?", "There are 60 minutes in an hour."),
    ("Is a tomato a fruit or a vegetable?", "A tomato is botanically a fruit."),
    ("What comes after Tuesday?", "Wednesday comes after Tuesday."),
)


@dataclass(frozen=True)
class Example:
    token_ids: list[int]  # chat prompt, reply, end token
    num_prompt_tokens: int


def tokenize(tokenizer: PreTrainedTokenizerBase, question: str, reply: str) -> Example:
    """The chat as inference sees it: the templated user turn, then the reply and the end-of-turn token."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    reply_ids = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return Example(prompt + reply_ids, len(prompt))


@dataclass(frozen=True)
class Batch:
    hidden: torch.Tensor          # [batch, seq, hidden] entering the first trained layer, right-padded
    attention_mask: torch.Tensor  # [batch, seq]
    targets: torch.Tensor         # [batch, seq]: the next token at each reply position, -100 elsewhere


def make_batches(model: LlamaForCausalLM, examples: list[Example], first_trained_layer: int,
                 pad_id: int) -> list[Batch]:
    """Batches of BATCH_SIZE consecutive examples with the frozen layers' output precomputed."""
    batches = []
    for start in range(0, len(examples), BATCH_SIZE):
        chunk = examples[start:start + BATCH_SIZE]
        width = max(len(e.token_ids) for e in chunk)
        ids = torch.tensor([e.token_ids + [pad_id] * (width - len(e.token_ids)) for e in chunk])
        mask = torch.tensor([[1] * len(e.token_ids) + [0] * (width - len(e.token_ids)) for e in chunk])
        targets = torch.full_like(ids, -100)
        for row, e in enumerate(chunk):
            targets[row, e.num_prompt_tokens - 1:len(e.token_ids) - 1] = ids[row, e.num_prompt_tokens:len(e.token_ids)]
        with torch.no_grad():
            hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False,
                                 output_hidden_states=True).hidden_states
        batches.append(Batch(hidden[first_trained_layer], mask, targets))
    return batches


def train_adapter(model_dir: Path, examples: list[Example], pad_id: int, out_dir: Path) -> None:
    torch.manual_seed(SEED)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    num_layers = model.config.num_hidden_layers
    first_trained_layer = num_layers - NUM_TRAINED_LAYERS
    by_length = sorted(examples, key=lambda e: len(e.token_ids))  # little padding
    batches = make_batches(model, by_length, first_trained_layer, pad_id)
    # From here on the model is its top layers, fed the cached hidden states.
    model.model.layers = model.model.layers[first_trained_layer:]
    model.config.num_hidden_layers = NUM_TRAINED_LAYERS
    peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=LORA_ALPHA, target_modules=TARGET_MODULES))
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    num_steps = NUM_EPOCHS * len(batches)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / num_steps)
    generator = torch.Generator().manual_seed(SEED)
    for epoch in range(NUM_EPOCHS):
        total = 0.0
        for index in torch.randperm(len(batches), generator=generator).tolist():
            loss = reply_loss(model, batches[index])
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            total += loss.item()
        print(f"  epoch {epoch + 1}/{NUM_EPOCHS}: loss {total / len(batches):.3f}", flush=True)
    save_adapter(peft_model, out_dir, first_trained_layer, num_layers)


def reply_loss(model: LlamaForCausalLM, batch: Batch) -> torch.Tensor:
    """Cross-entropy of the reply tokens; logits only where there is a target."""
    hidden = model.model(inputs_embeds=batch.hidden, attention_mask=batch.attention_mask,
                         use_cache=False).last_hidden_state
    positions = batch.targets != -100
    return F.cross_entropy(model.lm_head(hidden[positions]), batch.targets[positions])


def save_adapter(peft_model, out_dir: Path, first_trained_layer: int, num_layers: int) -> None:
    """adapter_config.json + bf16 adapter_model.safetensors in the full model's layer numbering."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = peft_model.peft_config["default"]
    config.base_model_name_or_path = PUBLISHED_BASE_MODEL
    config.layers_to_transform = list(range(first_trained_layer, num_layers))
    config.save_pretrained(str(out_dir))
    weights = {}
    for name, tensor in get_peft_model_state_dict(peft_model).items():
        name = re.sub(r"\.layers\.(\d+)\.", lambda m: f".layers.{int(m[1]) + first_trained_layer}.", name)
        weights[name] = tensor.to(torch.bfloat16).contiguous()
    save_file(weights, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEMO_ADAPTER_DIR, help="where the adapter directories go")
    parser.add_argument("--only", nargs="+", choices=list(STYLES), default=list(STYLES),
                        help="train these adapters (each is seeded on its own: the others do not change)")
    args = parser.parse_args()
    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()
    model_dir = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for name in args.only:
        style = STYLES[name]
        adapter_started = time.perf_counter()
        print(f"{name}:", flush=True)
        examples = [tokenize(tokenizer, question, style(answer)) for question, answer in EXAMPLES]
        train_adapter(model_dir, examples, tokenizer.pad_token_id, args.out / name)
        print(f"  saved {args.out / name} in {time.perf_counter() - adapter_started:.0f} s", flush=True)
    print(f"all adapters in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
