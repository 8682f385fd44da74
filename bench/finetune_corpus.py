"""The text ``bench/make_finetunes.py`` specialises its variants on, shipped here (no internet).

A variant is a *context distillation* of one persona: the base model answers
``TRAIN_PROMPTS`` under the persona's system prompt, and the variant is trained
to give those answers with no system prompt, so the persona ends up in its
weights (as a per-customer or per-task fine-tune would). ``EVAL_PROMPTS`` are
held out from training (the greedy answers the script compares) and
``HELD_OUT_TEXT`` is neutral prose for the perplexity that shows a variant is
still fluent. All of it was written for this repository.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Persona:
    """What one variant is specialised to: a short name and the system prompt it distils."""

    name: str
    system_prompt: str


PERSONAS: tuple[Persona, ...] = (
    Persona(
        "pirate", "You are a pirate. Answer every question in pirate speak, with 'Arr' and 'matey'."
    ),
    Persona("knight", "You are a medieval knight. Speak in old English with 'thee' and 'thou'."),
    Persona("chef", "You are a chef. Relate every answer to cooking and food."),
    Persona("poet", "You are a poet. Answer every question as a short rhyming poem."),
    Persona(
        "teacher",
        "You are a kindergarten teacher. Explain everything simply, as to a five-year-old child.",
    ),
    Persona(
        "butler",
        "You are a formal Victorian butler. Answer with elaborate courtesy, "
        "addressing the user as 'sir' or 'madam'.",
    ),
    Persona(
        "commentator",
        "You are an excited sports commentator. Answer with energy and exclamation marks!",
    ),
    Persona("terse", "You are a terse assistant. Answer in one short sentence, nothing more."),
)


def persona(index: int) -> Persona:
    """Variant ``index``'s persona; past the list it wraps (the seed still differs)."""
    return PERSONAS[index % len(PERSONAS)]


TRAIN_PROMPTS: tuple[str, ...] = (
    "How do I learn to swim?",
    "What is the capital of France?",
    "Why is the sky blue?",
    "Give me a tip for saving money.",
    "How do plants grow?",
    "What is a good breakfast?",
    "How can I sleep better?",
    "What is the moon made of?",
    "How do I start running?",
    "Why do cats purr?",
    "What should I pack for a trip to the beach?",
    "How does rain form?",
    "What is a computer program?",
    "How do I make a cup of tea?",
    "Why do leaves change colour in autumn?",
    "What is the best way to learn a language?",
    "How do birds fly?",
    "What makes a good friend?",
    "How do I clean my room quickly?",
    "What is electricity?",
    "How do I write a letter?",
    "Why is exercise important?",
    "What is the ocean like?",
    "How do I plant a tree?",
    "What are stars?",
    "How do I bake bread?",
    "Why do we need water?",
    "What is a volcano?",
    "How can I be more organised?",
    "What is the tallest mountain?",
    "How do I ride a bicycle?",
    "What is music?",
    "Why do we dream?",
    "How do I take care of a dog?",
    "What is the history of the castle?",
    "How do trains work?",
    "What is a healthy lunch?",
    "How do I stay calm before an exam?",
    "What is snow?",
    "How do I choose a good book?",
    "Why is the sea salty?",
    "What is a map for?",
    "How do bees make honey?",
    "What should I do when I feel bored?",
    "How do I tie my shoes?",
    "What is the wind?",
    "How do I make a new habit stick?",
    "Tell me about the weather today.",
    "What is a library?",
    "How do ships float?",
    "How should I prepare for a job interview?",
    "What is the sun?",
    "How do I paint a picture?",
    "Why do people travel?",
    "What is a good way to relax?",
    "How do fish breathe?",
    "What is a city?",
    "How do I save a file on a computer?",
    "What is a rainbow?",
    "How do I keep my plants alive?",
    "What is a good gift for a friend?",
    "How do clocks work?",
    "What is the desert like?",
    "How do I make soup?",
)

EVAL_PROMPTS: tuple[str, ...] = (
    "What should I do on a rainy afternoon?",
    "Explain what a bridge is for.",
    "How can I make new friends?",
)

HELD_OUT_TEXT = (
    "The village sat at the edge of a wide valley, where the river turned slowly to the east. "
    "In spring the fields were green and the farmers rose early to plant their crops. The "
    "children walked to school along a narrow road lined with old oak trees, and in the "
    "afternoon they played by the water until their parents called them home for dinner.\n\n"
    "A library is a place where books are kept so that anyone can read them. Most towns have "
    "one, and many libraries also lend music, films and computers. Librarians help visitors "
    "find what they are looking for, and they organise the shelves so that books on the same "
    "subject stand together.\n\n"
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air "
    "pressure is lower, so water boils at a lower temperature, and food takes longer to cook. "
    "This is why mountain climbers often use pressure cookers when they prepare their meals.\n\n"
    "To plant a small garden, choose a sunny spot, loosen the soil and remove any weeds. Sow "
    "the seeds at the depth written on the packet, water them gently every day, and be "
    "patient: most vegetables need several weeks before they are ready to harvest."
)
