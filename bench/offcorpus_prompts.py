"""Prompts unlike the bundled corpus, as many as wanted, the same ones for the same seed.

The bundled targets were trained on templated grade-school word problems ("Ana has 12
apples and gives 5 to Ben..."), function traces, small Python functions and JSON records
(`spot_common/corpus.py`). A job that learns its drafter meets prompts like these instead:
maths in other words and other domains, instructions, free questions, code requests in other
languages, classification, rewriting, translation, extraction, creative requests and advice.
Each kind has several phrasings whose slots are filled from word lists and numbers, so the
stream holds tens of thousands of distinct prompts.

Prompt `i` of seed `s` is a pure function of (s, i) (its own `random.Random`); repeats of an
earlier prompt are skipped, so the first N prompts of a seed are the same whatever N.

    .venv/bin/python bench/offcorpus_prompts.py --count 6000 --out build/offcorpus-6000.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

SEED = 34  # the committed seed of every table made from this stream

PEOPLE = [
    "Priya", "Mateo", "Yusuf", "Ingrid", "Kenji", "Amara", "Lucas", "Fatima", "Sofia", "Chen",
    "Oliver", "Anika", "Diego", "Hana", "Tariq", "Elena", "Kwame", "Marta", "Ravi", "Astrid",
]  # fmt: skip
COUNTRIES = [
    "France", "Kenya", "Canada", "Peru", "Norway", "Vietnam", "Egypt", "Chile", "Poland",
    "Thailand", "Ghana", "Portugal", "Mexico", "Finland", "India", "Morocco", "Ireland",
    "Argentina", "Japan", "Turkey", "Brazil", "Greece", "Sweden", "Nigeria", "Australia",
]  # fmt: skip
TOPICS = [
    "the ocean", "autumn leaves", "a quiet library", "city traffic", "a thunderstorm",
    "the first snow", "an old bridge", "a morning market", "the moon", "a lost key",
    "a mountain path", "coffee", "a train station", "a garden at night", "the desert wind",
    "a birthday", "an empty classroom", "fireflies", "a lighthouse", "rain on a window",
]  # fmt: skip
CONCEPTS = [
    "photosynthesis", "inflation", "gravity", "a black hole", "machine learning", "democracy",
    "the water cycle", "compound interest", "evolution", "an earthquake", "vaccination",
    "the internet", "a recession", "climate change", "electricity", "a solar eclipse",
    "blockchain", "supply and demand", "the immune system", "plate tectonics", "recycling",
    "a neural network", "the greenhouse effect", "a credit score", "encryption",
]  # fmt: skip
AUDIENCES = [
    "a child", "a teenager", "a grandparent", "a new employee", "a tourist", "a beginner",
    "a busy manager", "a student", "someone who has never heard of it",
]  # fmt: skip
ACTIVITIES = [
    "sleeping better", "learning a language", "saving money", "running a first marathon",
    "keeping houseplants alive", "studying for exams", "cooking rice", "writing a CV",
    "staying focused at work", "taking better photos", "packing for a trip",
    "public speaking", "reducing stress", "growing tomatoes", "starting a podcast",
    "drinking more water", "training a puppy", "learning to swim",
]  # fmt: skip
SUBJECTS = [
    "The city council", "A local bakery", "The school board", "Researchers at the university",
    "The football club", "A group of volunteers", "The national museum", "The airline",
    "A small tech company", "The hospital", "The weather service", "The village library",
    "Farmers in the region", "The orchestra", "The train operator",
]  # fmt: skip
EVENTS = [
    "announced a new plan to cut energy use by a third",
    "opened its doors on Sunday mornings for the first time",
    "raised enough money to repair the old roof",
    "delayed the project because of heavy rain",
    "hired twenty new staff after a busy summer",
    "won a national award for its work with young people",
    "reported record visitor numbers this year",
    "cancelled the evening service after complaints about noise",
    "launched a free course for adults who want to learn to code",
    "moved to a larger building near the river",
    "published a study showing that walking improves memory",
    "replaced its diesel buses with electric ones",
]  # fmt: skip
REASONS = [
    "citing strong demand from families",
    "after months of debate",
    "despite a tight budget",
    "following a successful trial",
    "to the surprise of many residents",
    "in response to a petition signed by thousands",
]  # fmt: skip
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Swedish"]
SENTENCES = [
    "The cat is sleeping on the chair.", "Where is the nearest train station?",
    "I would like a cup of tea, please.", "The museum opens at nine o'clock.",
    "My brother plays the guitar every evening.", "It is raining again today.",
    "Can you help me carry these boxes?", "We are going to the beach tomorrow.",
    "This soup is too salty.", "The children are reading in the garden.",
    "I forgot my umbrella at the office.", "How much does this ticket cost?",
    "The meeting has been moved to Thursday.", "She speaks three languages fluently.",
    "Please close the window before you leave.", "The bakery sells fresh bread every morning.",
]  # fmt: skip
PRODUCTS = [
    "a reusable water bottle", "an electric bike", "a language-learning app", "noise-cancelling "
    "headphones", "a plant-based burger", "a smart thermostat", "a travel backpack",
    "a budgeting app", "organic tea", "a solar phone charger", "a standing desk",
    "a sleep tracker", "handmade soap", "a board game for families",
]  # fmt: skip
CODE_LANGUAGES = ["Python", "JavaScript", "Rust", "Go", "Java", "C", "Ruby", "TypeScript"]
CODE_TASKS = [
    "checks whether a string is a palindrome", "returns the n-th Fibonacci number",
    "removes duplicates from a list", "counts the vowels in a string",
    "reverses the words of a sentence", "finds the largest number in an array",
    "checks whether a year is a leap year", "converts Celsius to Fahrenheit",
    "merges two sorted lists", "returns the factorial of a number",
    "capitalises the first letter of every word", "computes the average of a list",
    "checks whether a number is prime", "flattens a nested list",
    "counts how often each word appears in a text", "validates an email address",
    "sorts a list of names alphabetically", "returns the second smallest element",
]  # fmt: skip
PATTERNS = [
    "a date", "a UK postcode", "an email address", "a hex colour", "a phone number",
    "a time of day",
]  # fmt: skip
SHELL_TASKS = [
    "counts the lines of every .txt file", "finds files larger than 100 MB",
    "lists the ten newest files", "replaces tabs with spaces in a file",
]  # fmt: skip
TABLES = ["orders", "customers", "employees", "products", "invoices", "students", "flights"]
SQL_TASKS = [
    "counts the rows of", "lists the ten most recent entries in", "finds duplicate emails in",
    "computes the average price in", "deletes rows older than a year from",
    "returns the total per month from", "selects every row with a missing name from",
]  # fmt: skip
REVIEWS = [
    "The food was cold and the staff were rude.", "Absolutely loved it, will come back soon!",
    "It was fine, nothing special.", "The battery died after two days.",
    "Fast delivery and great quality.", "The hotel room smelled of smoke.",
    "Best concert I have been to in years.", "The instructions were confusing.",
    "Good value for the price, but the colour faded.", "I waited an hour and nobody came.",
    "The app crashes every time I open it.", "Friendly people and a lovely view.",
]  # fmt: skip
HEADLINES = [
    "Local team wins the cup after a dramatic penalty shoot-out",
    "Parliament passes new law on data privacy", "Scientists discover water ice on a distant moon",
    "Shares fall as the central bank raises interest rates",
    "Marathon runner breaks the course record", "New telescope captures images of a young star",
    "Start-up raises fifty million to build cheaper batteries",
    "Election results delayed by recount in three districts",
]  # fmt: skip
INFORMAL = [
    "hey, can u send me the report asap?", "the meeting was kinda pointless tbh",
    "gonna be late, traffic is crazy", "thx for the help yesterday, u rock",
    "can't make it tonight, sorry!!", "this price is way too high for us",
    "pls fix the printer, it's broken again", "we gotta talk about the budget",
]  # fmt: skip
MISTAKES = [
    "She don't like apples.", "Their going to the park tomorow.", "I has three brothers.",
    "The informations are wrong.", "He go to school by bus every days.",
    "We was happy with the resuts.", "Me and him is best friends.", "It's tail is very long.",
]  # fmt: skip
QUESTIONS = [
    "Why is the sky blue?", "Why do cats purr?", "How do airplanes stay in the air?",
    "Why do we dream?", "How does a refrigerator keep food cold?", "Why is the sea salty?",
    "How do bees make honey?", "Why do leaves change colour in autumn?",
    "How does a compass work?", "Why do onions make people cry?", "How are rainbows formed?",
    "Why do we have leap years?", "How do vaccines train the body?", "What causes tides?",
]  # fmt: skip
PAIRS = [
    ("weather", "climate"), ("a virus", "a bacterium"), ("a loan", "a grant"),
    ("speed", "velocity"), ("a lake", "a sea"), ("empathy", "sympathy"), ("RAM", "storage"),
    ("a crocodile", "an alligator"), ("baking soda", "baking powder"), ("a comet", "an asteroid"),
    ("affect", "effect"), ("a republic", "a monarchy"), ("a frog", "a toad"),
]  # fmt: skip
SITUATIONS = [
    "keep forgetting to water my plants", "have an exam in three days and feel unprepared",
    "moved to a new city and do not know anyone", "want to ask my manager for a raise",
    "spend too much time on my phone", "cannot decide between two job offers",
    "have a noisy neighbour", "want to start exercising but have little time",
    "am nervous about my first day at a new school", "keep waking up at 4 a.m.",
]  # fmt: skip
UNITS = [("kilometres", "miles"), ("kilograms", "pounds"), ("litres", "cups"), ("metres", "feet")]
ACTIONS = [
    "is painting the fence", "forgot the keys", "is waiting for the bus", "bought new shoes",
    "is cooking dinner", "lost the match", "is learning to drive", "found a wallet",
    "missed the flight", "is reading a mystery novel", "planted three trees",
    "fixed the old radio", "is writing a letter", "adopted a kitten", "won a small prize",
]  # fmt: skip
PLACES = [
    "at the station", "in the kitchen", "near the river", "at the office", "in the park",
    "at the airport", "on the balcony", "in the village", "at the market", "in the garage",
    "at the library", "by the sea",
]  # fmt: skip
TIMES = [
    "this morning", "last night", "every Sunday", "right now", "yesterday afternoon",
    "before lunch", "after work", "on Saturday",
]  # fmt: skip
PREFIXES = ["", "", "", "Please help. ", "Quick question. ", "For a school project: ",
            "I need this for work. ", "Hello! "]  # fmt: skip
SUFFIXES = [
    "", "", "", " Answer in one sentence.", " Be brief.", " Use bullet points.",
    " Explain your reasoning.", " Keep it under 50 words.", " Use simple words.",
    " Give an example.", " Reply in a friendly tone.",
]  # fmt: skip
FOODS = ["soup", "pancakes", "bread", "curry", "lemonade", "cookies", "risotto", "salad"]


def _sentence(rng: random.Random) -> str:
    """A plain sentence about someone (tens of thousands of them)."""
    return f"{rng.choice(PEOPLE)} {rng.choice(ACTIONS)} {rng.choice(PLACES)} {rng.choice(TIMES)}."


def _maths(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 90), rng.randint(2, 40), rng.randint(3, 12)
    person, food = rng.choice(PEOPLE), rng.choice(FOODS)
    options: list[Callable[[], str]] = [
        lambda: f"What is {rng.choice([5, 10, 15, 20, 25, 40, 75])} percent of {a * 20}?",
        lambda: f"Solve for x: {c}x + {b} = {c * a + b}.",
        lambda: (
            f"A recipe for {c} people needs {a * c} grams of sugar. How much sugar does "
            f"a version for {c * 2} people need?"
        ),
        lambda: (
            f"A jacket costs {a * 4} euros and is reduced by {rng.choice([10, 20, 25, 50])}"
            "%. What is the new price?"
        ),
        lambda: f"Convert {a * 7} minutes into hours and minutes.",
        lambda: f"How many seconds are there in {c} hours?",
        lambda: (
            f"The temperature was {-b} degrees at dawn and rose by {a} degrees by noon. "
            "What was the temperature at noon?"
        ),
        lambda: (
            f"A car uses {c} litres of fuel per 100 km. How much fuel does it need for {a * 10} km?"
        ),
        lambda: f"What is the average of {a}, {b} and {a + b + c}?",
        lambda: f"What is the remainder when {a * c + b} is divided by {c}?",
        lambda: f"Is {a * b + c} a prime number?",
        lambda: f"What is the area of a circle with a radius of {c} metres?",
        lambda: f"A square field has a perimeter of {4 * a} metres. How long is one side?",
        lambda: f"{person} reads {c} pages an hour. How long does a {a * c}-page novel take?",
        lambda: (
            f"A bus leaves at {c}:{rng.choice(['05', '15', '40', '55'])} and the trip takes "
            f"{a + 30} minutes. When does it arrive?"
        ),
        lambda: f"Write {a * 100 + b} in words.",
        lambda: f"What is {a} squared minus {b} squared?",
        lambda: f"Order these numbers from smallest to largest: {a}, {b * 3}, {c}, {a + b}.",
        lambda: (
            f"If {person} makes {food} for {c} friends and each needs {b} grams, how many "
            "kilograms is that?"
        ),
        lambda: (
            f"A savings account pays {rng.choice([2, 3, 4, 5])}% interest a year. How much "
            f"does {a * 100} dollars earn in one year?"
        ),
        lambda: "How many {1} are {0} {2}?".format(a, *reversed(rng.choice(UNITS))),
        lambda: f"What fraction of {c * b} is {b}? Simplify it.",
        lambda: (
            f"The ratio of boys to girls in a club is {c}:{b}. If there are {c * 6} boys, "
            "how many girls are there?"
        ),
        lambda: f"Estimate {a * 11 + 7} times {b + 9} to the nearest hundred.",
    ]
    return rng.choice(options)()


def _instruction(rng: random.Random) -> str:
    subject, event, reason = rng.choice(SUBJECTS), rng.choice(EVENTS), rng.choice(REASONS)
    news = f"{subject} {event} on {rng.choice(['Monday', 'Tuesday', 'Friday'])}, {reason}."
    options = [
        lambda: f"Summarise in one sentence: {news}",
        lambda: f"Write a headline for this news: {news}",
        lambda: f"Explain {rng.choice(CONCEPTS)} to {rng.choice(AUDIENCES)}.",
        lambda: f"Give {rng.randint(2, 6)} tips for {rng.choice(ACTIVITIES)}.",
        lambda: f"Describe {rng.choice(TOPICS)} in {rng.randint(3, 12)} words.",
        lambda: f"Write a short email to {rng.choice(PEOPLE)} about this: {news}",
        lambda: f"List {rng.randint(3, 7)} questions a journalist could ask about this: {news}",
        lambda: f"Write step-by-step instructions for {rng.choice(ACTIVITIES)}.",
        lambda: f"Make a shopping list for {rng.choice(FOODS)} for {rng.randint(2, 9)} people.",
        lambda: f"Plan a {rng.randint(2, 5)}-day trip to {rng.choice(COUNTRIES)}.",
    ]
    return rng.choice(options)()


def _question(rng: random.Random) -> str:
    x, y = rng.choice(PAIRS)
    options = [
        lambda: f"What is the capital of {rng.choice(COUNTRIES)}?",
        lambda: f"Which languages are spoken in {rng.choice(COUNTRIES)}?",
        lambda: rng.choice(QUESTIONS),
        lambda: f"What is the difference between {x} and {y}?",
        lambda: f"What is {rng.choice(CONCEPTS)}?",
        lambda: f"Is {rng.choice(CONCEPTS)} good or bad for society? Answer briefly.",
        lambda: f"What should I know before visiting {rng.choice(COUNTRIES)}?",
        lambda: f"Name {rng.randint(2, 5)} famous dishes from {rng.choice(COUNTRIES)}.",
        lambda: f"How long does it take to learn {rng.choice(LANGUAGES)}?",
        lambda: f"Who was the first person to study {rng.choice(CONCEPTS)}?",
    ]
    return rng.choice(options)()


def _code(rng: random.Random) -> str:
    lang, task = rng.choice(CODE_LANGUAGES), rng.choice(CODE_TASKS)
    n, k = rng.randint(2, 9), rng.randint(2, 5)
    options = [
        lambda: f"Write a {lang} function that {task}.",
        lambda: f"Write a SQL query that {rng.choice(SQL_TASKS)} the table {rng.choice(TABLES)}.",
        lambda: f"Explain what this {lang} code does: a function that {task}.",
        lambda: f"What does this code print?\nfor i in range({n}):\n    print(i * {k})",
        lambda: f"What does this code print?\nx = [{n}, {k}, {n + k}]\nprint(sorted(x)[::-1])",
        lambda: f"Write a unit test for a function that {task}.",
        lambda: f"Write a regular expression that matches {rng.choice(PATTERNS)}.",
        lambda: f"Write a shell command that {rng.choice(SHELL_TASKS)}.",
        lambda: (
            f"Convert this loop to a list comprehension:\nout = []\nfor v in data:\n    "
            f"if v > {n}:\n        out.append(v * {k})"
        ),
        lambda: f"What is the time complexity of a program that {task}?",
    ]
    return rng.choice(options)()


def _classification(rng: random.Random) -> str:
    options = [
        lambda: (
            "Classify the sentiment of this review as positive, negative or neutral: "
            + rng.choice(REVIEWS)
        ),
        lambda: (
            "Which category does this headline belong to: sports, politics, science or "
            f"business? {rng.choice(HEADLINES)}"
        ),
        lambda: (
            "Is this message spam? Answer yes or no: "
            + rng.choice(
                [
                    f"You have won {rng.randint(2, 9)}00 dollars! Click here to claim your prize.",
                    f"Hi {rng.choice(PEOPLE)}, are we still meeting at {rng.randint(1, 9)} pm?",
                    "Your parcel is waiting. Pay a small fee at this link to release it.",
                    "Reminder: the team lunch is moved to Friday.",
                ]
            )
        ),
        lambda: f"Is this sentence about work, home or leisure? {_sentence(rng)}",
        lambda: (
            f"Is this sentence a fact or an opinion? {rng.choice(SUBJECTS)} {rng.choice(EVENTS)}."
        ),
        lambda: f"Rate the politeness of this message from 1 to 5: {rng.choice(INFORMAL)}",
        lambda: (
            f"Is {rng.choice(['a tomato', 'a whale', 'a mushroom', 'a peanut', 'a bat'])} "
            f"{rng.choice(['a fruit', 'a mammal', 'a plant', 'a vegetable', 'a nut'])}?"
        ),
    ]
    return rng.choice(options)()


def _rewriting(rng: random.Random) -> str:
    options = [
        lambda: f"Rewrite more formally: {rng.choice(INFORMAL)}",
        lambda: f"Correct the grammar: {rng.choice(MISTAKES)}",
        lambda: (
            f"Make this sentence shorter: {rng.choice(SUBJECTS)} {rng.choice(EVENTS)}, "
            f"{rng.choice(REASONS)}."
        ),
        lambda: f"Rewrite in the passive voice: {rng.choice(SUBJECTS)} {rng.choice(EVENTS)}.",
        lambda: f"Turn this into a question: {_sentence(rng)}",
        lambda: f"Paraphrase: {_sentence(rng)}",
        lambda: f"Rewrite in the past tense: {_sentence(rng)}",
        lambda: f"Rewrite in the first person: {_sentence(rng)}",
        lambda: (
            f"Rewrite this for {rng.choice(AUDIENCES)}: {rng.choice(SUBJECTS)} "
            f"{rng.choice(EVENTS)}."
        ),
    ]
    return rng.choice(options)()


def _translation(rng: random.Random) -> str:
    text = rng.choice(SENTENCES) if rng.random() < 0.3 else _sentence(rng)
    return f"Translate into {rng.choice(LANGUAGES)}: {text}"


def _extraction(rng: random.Random) -> str:
    person, other = rng.sample(PEOPLE, 2)
    day, month = rng.randint(1, 28), rng.choice(["March", "June", "October", "January"])
    text = (
        f"{person} met {other} in {rng.choice(COUNTRIES)} on {day} {month} and they bought "
        f"{rng.randint(2, 30)} tickets for {rng.randint(10, 99)} dollars."
    )
    options = [
        lambda: f"List the numbers that appear in this text: {text}",
        lambda: f"Extract the date from this text: {text}",
        lambda: f"Who is mentioned in this text? {text}",
        lambda: f"Turn this text into a table with columns who, where and when: {text}",
        lambda: f"Which country is mentioned here? {text}",
    ]
    return rng.choice(options)()


def _creative(rng: random.Random) -> str:
    options = [
        lambda: f"Write a haiku about {rng.choice(TOPICS)}.",
        lambda: f"Write a two-line poem about {rng.choice(TOPICS)}.",
        lambda: f"Write a slogan for {rng.choice(PRODUCTS)}.",
        lambda: f"Suggest {rng.randint(2, 5)} names for {rng.choice(PRODUCTS)}.",
        lambda: (
            f"Start a short story about {rng.choice(PEOPLE)}, who finds {rng.choice(TOPICS)}"
            " strange."
        ),
        lambda: f"Write a limerick about {rng.choice(PEOPLE)} and {rng.choice(FOODS)}.",
        lambda: f"Give a short title for a story about {rng.choice(TOPICS)}.",
        lambda: f"Write a product description for {rng.choice(PRODUCTS)}.",
    ]
    return rng.choice(options)()


def _advice(rng: random.Random) -> str:
    options = [
        lambda: f"I {rng.choice(SITUATIONS)}. What should I do?",
        lambda: f"My friend {rng.choice(SITUATIONS).replace('my ', 'their ')}. How can I help?",
        lambda: f"Give me a weekly plan for {rng.choice(ACTIVITIES)}.",
        lambda: f"What are the pros and cons of {rng.choice(PRODUCTS)}?",
    ]
    return rng.choice(options)()


KINDS: dict[str, Callable[[random.Random], str]] = {
    "maths": _maths, "instruction": _instruction, "question": _question, "code": _code,
    "classification": _classification, "rewriting": _rewriting, "translation": _translation,
    "extraction": _extraction, "creative": _creative, "advice": _advice,
}  # fmt: skip
SHARES = {  # relative frequency of each kind in the stream
    "maths": 3, "instruction": 2, "question": 2, "code": 2, "classification": 1,
    "rewriting": 1, "translation": 1, "extraction": 1, "creative": 1, "advice": 1,
}  # fmt: skip


def draw(seed: int, index: int) -> dict:
    """Candidate `index` of `seed`'s stream: {id, kind, prompt}, a pure function of both.
    Most prompts come bare; some with a greeting before or a request on form after."""
    rng = random.Random(f"offcorpus:{seed}:{index}")
    kind = rng.choices(sorted(KINDS), weights=[SHARES[k] for k in sorted(KINDS)])[0]
    text = rng.choice(PREFIXES) + KINDS[kind](rng) + rng.choice(SUFFIXES)
    return {"id": f"oc{seed}-{index}", "kind": kind, "prompt": text}


def stream(seed: int = SEED) -> Iterator[dict]:
    """The seed's distinct prompts in order (a candidate equal to an earlier one is skipped)."""
    seen: set[str] = set()
    index = 0
    while True:
        row = draw(seed, index)
        index += 1
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            yield row


def offcorpus_prompts(count: int, seed: int = SEED, skip: int = 0) -> list[dict]:
    """Prompts `skip` .. `skip + count` of the seed's distinct stream."""
    rows = stream(seed)
    for _ in range(skip):
        next(rows)
    return [next(rows) for _ in range(count)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--count", type=int, default=6000)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--out", required=True, help="JSON Lines of {id, kind, prompt}")
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for row in offcorpus_prompts(args.count, args.seed):
            f.write(json.dumps(row) + "\n")
    print(f"{args.count} prompts of seed {args.seed} -> {out}")


if __name__ == "__main__":
    main()
