#!/usr/bin/env python3
"""Seeded generator of multi-document QA prompts in the RAG shape (HYPIC issue 4).

Every prompt is a small fictional world (people, companies, cities, products) of which
3-8 entities get a document each.  A document describes one entity: an intro sentence,
its facts written as varied sentences, and filler sentences (some of them mentioning
other entities of the world as distractors) up to a target length of 100-1000 tokens.
Questions are single-hop (the answer is a fact of one documented entity) or two-hop (a
chain of two facts from two different documents, e.g. "In which city was the founder of
Zentrix born?").  Answers are short strings (a name, a year, a profession, a country).
The trained reply to a two-hop question first names the bridge entity, then the answer
("Brourkis Larkkener -> Shyrford", see ``reply_text``); scoring uses the final answer.

Each example is generated from its own RNG, ``random.Random(f"{seed}:{index}")``, so
example ``index`` of split ``seed`` is the same whatever the process or worker count.

Seeds used by HYPIC (never reuse the held-out seed for training):
    tokenizer corpus   seed 11
    training stream    seed 1234          (tools/train/train.py --seed)
    validation         seed 4242          (monitoring during training only)
    held-out eval      seed 20261129      (models/hypic-tiny/eval/heldout.jsonl)

The prompt and segment format is defined in tools/README-train.md and
models/hypic-tiny/eval/FORMAT.md; ``segments()`` below is its reference implementation.

CLI:
    python tools/train/gen_corpus.py --seed 20261129 --n 640 --tokenizer models/hypic-tiny/tokenizer.json \
        --heldout --out models/hypic-tiny/eval/heldout.jsonl
    python tools/train/gen_corpus.py --seed 1234 --n 1000 --out /tmp/train.jsonl     # training-style
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass, field

import regex

# ------------------------------------------------------------------------------------
# Prompt format (the Rust engine reproduces this exactly)
# ------------------------------------------------------------------------------------
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# Qwen2 pre-tokenizer regex (transformers 5.17 tokenization_qwen2.py); our tokenizer.json
# uses exactly this one, as the real Qwen3-Next tokenizer does.
QWEN2_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
_PRETOK = regex.compile(QWEN2_REGEX)

SYSTEM_PROMPTS = [
    "You are a helpful assistant. Answer the question using only the documents. Reply with a short answer.",
    "You answer questions about the documents below. Give only the answer, as short as possible.",
    "Read the documents and answer the question. The answer is a name, a year or a single word.",
    "You are a careful reader. Use the documents to answer the question with a short answer only.",
]


def system_segment(system: str) -> str:
    return f"{IM_START}system\n{system}{IM_END}\n{IM_START}user\n"


def document_segment(doc: str) -> str:
    return f"{doc}\n\n"


def question_segment(question: str) -> str:
    return f"Question: {question}{IM_END}\n{IM_START}assistant\n"


def segments(ex: dict) -> list[str]:
    """The prompt as segments: [system, doc_1, ..., doc_n, question]; ''.join() is the prompt."""
    return (
        [system_segment(ex["system"])]
        + [document_segment(d) for d in ex["documents"]]
        + [question_segment(ex["question"])]
    )


def prompt_text(ex: dict) -> str:
    return "".join(segments(ex))


BRIDGE_SEP = " -> "


def reply_text(answer: str, bridge: str | None) -> str:
    """The assistant's reply to one question, without <|im_end|>: the answer itself for a
    single-hop question; for a two-hop question the bridge entity (the first hop's value,
    read from one document), `BRIDGE_SEP`, then the answer (read from the bridge's
    document). Scoring takes the text after the last `BRIDGE_SEP` (`final_answer`)."""
    return answer if not bridge else f"{bridge}{BRIDGE_SEP}{answer}"


def final_answer(reply: str) -> str:
    """The answer part of a generated reply: the text after the last `BRIDGE_SEP`, else
    the whole reply; stripped."""
    i = reply.rfind(BRIDGE_SEP.strip())
    return (reply[i + len(BRIDGE_SEP.strip()):] if i >= 0 else reply).strip()


def answer_text(ex: dict) -> str:
    """What the model is trained to generate after the prompt (generation stops at <|im_end|>)."""
    return f"{reply_text(ex['answer'], ex.get('bridge'))}{IM_END}"


def followup_text(question: str, answer: str | None) -> str:
    """A further chat turn (training only): the chat template's rendering of one more
    user message and assistant reply after an assistant message."""
    s = f"\n{IM_START}user\nQuestion: {question}{IM_END}\n{IM_START}assistant\n"
    return s if answer is None else s + f"{answer}{IM_END}"


# ------------------------------------------------------------------------------------
# Names
# ------------------------------------------------------------------------------------
ONSETS = ["b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
          "gr", "kr", "st", "th", "tr", "sh", "ch", "pl", "fl", "qu", "j", "w", "y", "c", "x"]
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "i", "o", "u", "ai", "ei", "ou", "y"]
CODAS = ["", "", "", "", "n", "r", "l", "s", "m", "th", "x", "nd", "rk"]
FEMALE_END = ["a", "ia", "ine", "elle", "ena", "ara", "ette", "is"]
MALE_END = ["o", "an", "ik", "or", "us", "en", "im", "ard"]
CITY_END = ["ia", "burg", "ton", "vale", "ora", "holm", "wick", "stad", "mere", "ford", "polis", "ane"]
COUNTRY_END = ["land", "ia", "onia", "istan", "avia", "aria", "esh", "ovia"]
COMPANY_END = ["ix", "tek", "ora", "corp", "ex", "on", "ify", "io", "ar", "yn"]
COMPANY_SUFFIX = ["", "", "", " Labs", " Systems", " Industries", " Group", " Works", " Dynamics", " Foods"]
PRODUCT_END = ["o", "ex", "a", "on", "ix", "us", "ium", "ara"]


def _syl(rng: random.Random) -> str:
    return rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)


def _word(rng: random.Random, end: list[str], nsyl: tuple[int, int] = (1, 2)) -> str:
    n = nsyl[0] if rng.random() < 0.6 else rng.randint(*nsyl)
    w = "".join(_syl(rng) for _ in range(n)) + rng.choice(end)
    return w[:1].upper() + w[1:]


def person_name(rng, female: bool) -> str:
    first = _word(rng, FEMALE_END if female else MALE_END, (1, 2))
    last = _word(rng, ["", "", "er", "son", "ley", "ini", "ov", "ard", "ez", "ell"], (1, 2))
    return f"{first} {last}"


def city_name(rng) -> str:
    return _word(rng, CITY_END, (1, 2))


def country_name(rng) -> str:
    return _word(rng, COUNTRY_END, (1, 2))


def company_name(rng) -> str:
    return _word(rng, COMPANY_END, (1, 2)) + rng.choice(COMPANY_SUFFIX)


def product_name(rng) -> str:
    n = _word(rng, PRODUCT_END, (1, 2))
    return n + (f" {rng.randint(2, 9)}" if rng.random() < 0.25 else "")


# ------------------------------------------------------------------------------------
# Vocabulary for attributes and fillers
# ------------------------------------------------------------------------------------
OCCUPATIONS = ["architect", "baker", "pilot", "surgeon", "painter", "chemist", "lawyer", "teacher",
               "journalist", "engineer", "farmer", "sculptor", "banker", "novelist", "photographer",
               "pharmacist", "carpenter", "astronomer", "economist", "violinist", "geologist", "nurse",
               "translator", "mechanic", "diplomat", "librarian", "chef", "botanist", "dentist", "poet"]
INDUSTRIES = ["software", "shipping", "food", "energy", "textile", "robotics", "publishing", "mining",
              "toy", "furniture", "aviation", "medical", "telecom", "chemical", "bicycle", "insurance"]
CATEGORIES = ["drone", "kettle", "camera", "bicycle", "tablet", "lamp", "watch", "speaker", "tractor",
              "vacuum cleaner", "sewing machine", "headset", "coffee machine", "printer", "scooter", "telescope"]
HOBBIES = ["sailing", "chess", "gardening", "painting", "rowing", "climbing", "birdwatching", "cooking",
           "fishing", "knitting", "running", "pottery", "dancing", "cycling", "reading poetry", "baking bread"]
ADJS = ["quiet", "cheerful", "patient", "curious", "generous", "stubborn", "careful", "modest", "witty",
        "ambitious", "calm", "friendly", "serious", "bold", "thoughtful", "lively"]
CITY_FEATURES = ["old harbour", "stone bridges", "night markets", "botanical garden", "clock tower",
                 "narrow streets", "lighthouse", "music festival", "white cliffs", "wooden churches",
                 "tea houses", "canals", "museum of glass", "hot springs", "city walls", "opera house"]
EVENTS = ["conference", "wedding", "festival", "trade fair", "concert", "workshop", "dinner", "race"]
PETS = ["dog", "cat", "parrot", "horse", "rabbit", "tortoise"]
SUBJECTS = ["history", "physics", "music", "biology", "law", "mathematics", "philosophy", "geography"]
GENRES = ["mystery novels", "old maps", "travel books", "science fiction", "biographies", "poetry"]
COLORS = ["red", "blue", "black", "white", "green", "silver", "orange", "grey", "yellow"]
QUALITIES = ["reliable service", "low prices", "careful design", "friendly staff", "fast delivery"]
FACILITIES = ["factory", "warehouse", "research centre", "training school", "shop", "laboratory"]
SPORTS = ["football", "cycling", "rowing", "basketball", "hockey", "sailing"]
SEASONS = ["spring", "summer", "autumn", "winter"]
WEATHER = ["rainy", "windy", "mild", "cold", "dry", "hot"]


# ------------------------------------------------------------------------------------
# World
# ------------------------------------------------------------------------------------
@dataclass
class Entity:
    kind: str  # person | company | city | product
    name: str
    attrs: dict = field(default_factory=dict)
    female: bool = False


# relation -> (subject kind, object kind or "value")
RELATIONS = {
    "person.birthplace": ("person", "city"),
    "person.birth_year": ("person", "value"),
    "person.mother": ("person", "person"),
    "person.father": ("person", "person"),
    "person.employer": ("person", "company"),
    "person.occupation": ("person", "value"),
    "company.founder": ("company", "person"),
    "company.ceo": ("company", "person"),
    "company.hq": ("company", "city"),
    "company.founded": ("company", "value"),
    "company.product": ("company", "product"),
    "city.country": ("city", "value"),
    "city.mayor": ("city", "person"),
    "product.maker": ("product", "company"),
    "product.launched": ("product", "value"),
}

CHAINS = [(r1, r2) for r1, r2 in [
    ("company.founder", "person.birthplace"), ("company.founder", "person.birth_year"),
    ("company.founder", "person.mother"), ("company.founder", "person.father"),
    ("company.founder", "person.occupation"),
    ("company.ceo", "person.birthplace"), ("company.ceo", "person.birth_year"),
    ("company.ceo", "person.mother"), ("company.ceo", "person.father"), ("company.ceo", "person.occupation"),
    ("company.hq", "city.country"), ("company.hq", "city.mayor"),
    ("product.maker", "company.founder"), ("product.maker", "company.ceo"),
    ("product.maker", "company.hq"), ("product.maker", "company.founded"),
    ("person.employer", "company.founder"), ("person.employer", "company.ceo"),
    ("person.employer", "company.hq"), ("person.employer", "company.founded"),
    ("person.employer", "company.product"),
    ("person.mother", "person.birthplace"), ("person.mother", "person.birth_year"),
    ("person.mother", "person.occupation"), ("person.mother", "person.employer"),
    ("person.father", "person.birthplace"), ("person.father", "person.birth_year"),
    ("person.father", "person.occupation"), ("person.father", "person.employer"),
    ("person.birthplace", "city.country"), ("person.birthplace", "city.mayor"),
    ("city.mayor", "person.birthplace"), ("city.mayor", "person.birth_year"),
    ("city.mayor", "person.employer"), ("city.mayor", "person.occupation"),
    ("company.product", "product.launched"),
]]


def build_world(rng: random.Random) -> dict[str, Entity]:
    used: set[str] = set()

    def fresh(fn, *a) -> str:
        for _ in range(1000):
            n = fn(rng, *a)
            # unique full names, and no name is a prefix of another (word-wise)
            if n not in used and not any(u.startswith(n + " ") or n.startswith(u + " ") for u in used):
                used.add(n)
                return n
        raise RuntimeError("name space exhausted")

    n_person, n_company, n_city, n_product = rng.randint(12, 18), rng.randint(4, 7), rng.randint(5, 8), rng.randint(4, 7)
    n_product = max(n_product, n_company)
    n_person = max(n_person, 2 * n_company + 2)
    countries = [fresh(country_name) for _ in range(rng.randint(3, 5))]
    persons = []
    for _ in range(n_person):
        female = rng.random() < 0.5
        persons.append(Entity("person", fresh(person_name, female), female=female))
    if sum(p.female for p in persons) < 3:
        for p in persons[:3]:
            p.female = True
            used.discard(p.name)
            p.name = fresh(person_name, True)
    companies = [Entity("company", fresh(company_name)) for _ in range(n_company)]
    cities = [Entity("city", fresh(city_name)) for _ in range(n_city)]
    products = [Entity("product", fresh(product_name)) for _ in range(n_product)]

    females = [p for p in persons if p.female]
    males = [p for p in persons if not p.female] or persons
    for p in persons:
        p.attrs["birthplace"] = rng.choice(cities).name
        p.attrs["birth_year"] = str(rng.randint(1901, 1999))
        p.attrs["mother"] = rng.choice([f for f in females if f is not p]).name
        p.attrs["father"] = rng.choice([m for m in males if m is not p] or [m for m in persons if m is not p]).name
        p.attrs["employer"] = rng.choice(companies).name
        p.attrs["occupation"] = rng.choice(OCCUPATIONS)
    people = persons[:]
    rng.shuffle(people)
    prods = products[:]
    rng.shuffle(prods)
    for i, c in enumerate(companies):
        c.attrs["founder"] = people[2 * i].name
        c.attrs["ceo"] = people[2 * i + 1].name
        c.attrs["hq"] = rng.choice(cities).name
        c.attrs["founded"] = str(rng.randint(1850, 2020))
        c.attrs["product"] = prods[i].name
        c.attrs["industry"] = rng.choice(INDUSTRIES)
        prods[i].attrs["maker"] = c.name
        # founders and CEOs work for their own company (no contradicting documents)
        people[2 * i].attrs["employer"] = c.name
        people[2 * i + 1].attrs["employer"] = c.name
    for r in products:
        if "maker" not in r.attrs:  # extra products: made by a company that also makes another
            r.attrs["maker"] = None
        r.attrs["launched"] = str(rng.randint(1950, 2025))
        r.attrs["category"] = rng.choice(CATEGORIES)
    for y in cities:
        y.attrs["country"] = rng.choice(countries)
        y.attrs["mayor"] = rng.choice(persons).name
    world = {e.name: e for e in persons + companies + cities + products}
    # products without a maker are never documented (keeps product.maker a function)
    return {n: e for n, e in world.items() if not (e.kind == "product" and e.attrs["maker"] is None)}


def rel_value(world: dict[str, Entity], name: str, rel: str) -> str | None:
    e = world[name]
    kind, attr = rel.split(".")
    if e.kind != kind:
        return None
    return e.attrs.get(attr)


# ------------------------------------------------------------------------------------
# Sentences
# ------------------------------------------------------------------------------------
def _pro(e: Entity) -> tuple[str, str]:
    return ("she", "her") if e.female else ("he", "his")


def intro_sentence(rng, e: Entity) -> str:
    a = e.attrs
    if e.kind == "person":
        art = "an" if a["occupation"][0] in "aeiou" else "a"
        return rng.choice([
            f"{e.name} is {art} {a['occupation']}.",
            f"{e.name} works as {art} {a['occupation']}.",
            f"By profession, {e.name} is {art} {a['occupation']}.",
            f"{e.name} is {art} {rng.choice(ADJS)} {a['occupation']}.",
        ])
    if e.kind == "company":
        return rng.choice([
            f"{e.name} is a {a['industry']} company.",
            f"{e.name} is a company in the {a['industry']} business.",
            f"{e.name} is a {rng.choice(ADJS)} {a['industry']} firm.",
        ])
    if e.kind == "city":
        return rng.choice([
            f"{e.name} is a city in {a['country']}.",
            f"{e.name} is a {rng.choice(['small', 'large', 'busy', 'old', 'quiet'])} city located in {a['country']}.",
            f"The city of {e.name} lies in {a['country']}.",
        ])
    art = "an" if a["category"][0] in "aeiou" else "a"
    return rng.choice([
        f"{e.name} is {art} {a['category']}.",
        f"{e.name} is {art} {rng.choice(ADJS)} {a['category']}.",
        f"The {e.name} is a popular {a['category']}.",
    ])


def fact_sentences(rng, e: Entity) -> list[str]:
    """One sentence per askable fact of e (the city's country is in its intro)."""
    a, n = e.attrs, e.name
    s: list[str] = []
    if e.kind == "person":
        if rng.random() < 0.25:
            s.append(rng.choice([f"{n} was born in {a['birthplace']} in {a['birth_year']}.",
                                 f"{n} was born in {a['birth_year']} in the city of {a['birthplace']}."]))
        else:
            s.append(rng.choice([f"{n} was born in {a['birthplace']}.", f"The birthplace of {n} is {a['birthplace']}.",
                                 f"{n} was born in the city of {a['birthplace']}.", f"{n} comes from {a['birthplace']}, where {_pro(e)[0]} was born."]))
            s.append(rng.choice([f"{n} was born in {a['birth_year']}.", f"{n} was born in the year {a['birth_year']}.",
                                 f"The year of birth of {n} is {a['birth_year']}."]))
        s.append(rng.choice([f"The mother of {n} is {a['mother']}.", f"{a['mother']} is the mother of {n}.",
                             f"{n} is a child of {a['mother']}, {_pro(e)[1]} mother."]))
        s.append(rng.choice([f"The father of {n} is {a['father']}.", f"{a['father']} is the father of {n}.",
                             f"{n}'s father is {a['father']}."]))
        s.append(rng.choice([f"{n} works for {a['employer']}.", f"{n} is employed by {a['employer']}.",
                             f"{n} has a job at {a['employer']}.", f"The employer of {n} is {a['employer']}."]))
    elif e.kind == "company":
        if rng.random() < 0.25:
            s.append(rng.choice([f"{a['founder']} founded {n} in {a['founded']}.",
                                 f"{n} was founded in {a['founded']} by {a['founder']}."]))
        else:
            s.append(rng.choice([f"{n} was founded by {a['founder']}.", f"{a['founder']} founded {n}.",
                                 f"The founder of {n} is {a['founder']}.", f"{n} was started by its founder, {a['founder']}."]))
            s.append(rng.choice([f"{n} was founded in {a['founded']}.", f"{n} was established in {a['founded']}.",
                                 f"{n} has existed since its founding in {a['founded']}."]))
        s.append(rng.choice([f"The CEO of {n} is {a['ceo']}.", f"{a['ceo']} is the chief executive of {n}.",
                             f"{n} is led by its CEO, {a['ceo']}.", f"{a['ceo']} serves as the CEO of {n}."]))
        s.append(rng.choice([f"{n} is headquartered in {a['hq']}.", f"The headquarters of {n} are in {a['hq']}.",
                             f"{n} has its main office in {a['hq']}.", f"{n} is based in {a['hq']}."]))
        s.append(rng.choice([f"{n} makes {a['product']}.", f"{n} produces the {a['product']}.",
                             f"The best known product of {n} is {a['product']}.", f"{a['product']} is made by {n}."]))
    elif e.kind == "city":
        s.append(rng.choice([f"The mayor of {n} is {a['mayor']}.", f"{a['mayor']} is the mayor of {n}.",
                             f"{n} is governed by its mayor, {a['mayor']}."]))
    else:
        s.append(rng.choice([f"{n} is made by {a['maker']}.", f"{a['maker']} manufactures {n}.",
                             f"{n} is produced by {a['maker']}.", f"The maker of {n} is {a['maker']}."]))
        s.append(rng.choice([f"{n} was launched in {a['launched']}.", f"{n} first went on sale in {a['launched']}.",
                             f"{n} was released in {a['launched']}."]))
    return s


def filler_sentence(rng, e: Entity, world_names: dict[str, list[str]]) -> str:
    """A sentence with no askable fact about e; may mention other entities (distractors)."""
    n = e.name
    other = lambda kind: rng.choice(world_names[kind])  # noqa: E731
    k = rng.randint
    if e.kind == "person":
        he, his = _pro(e)
        return rng.choice([
            f"{n} enjoys {rng.choice(HOBBIES)}.", f"In {his} free time, {n} likes {rng.choice(HOBBIES)}.",
            f"{n} speaks {k(2, 6)} languages.", f"Friends describe {n} as {rng.choice(ADJS)} and {rng.choice(ADJS)}.",
            f"{n} once visited {other('city')} for a {rng.choice(EVENTS)}.",
            f"{n} met {other('person')} at a {rng.choice(EVENTS)} in {k(1950, 2024)}.",
            f"{n} owns a {rng.choice(PETS)} that {he} walks every morning.",
            f"{n} reads a lot of {rng.choice(GENRES)}.", f"{n} studied {rng.choice(SUBJECTS)} at university.",
            f"Every {rng.choice(SEASONS)}, {n} travels to {other('city')}.",
            f"{n} has written {k(2, 40)} articles about {rng.choice(SUBJECTS)}.",
            f"Colleagues say that {n} is {rng.choice(ADJS)} at work.",
            f"{n} once gave a talk on {rng.choice(SUBJECTS)} together with {other('person')}.",
            f"{n} lives in a house with a {rng.choice(COLORS)} door.",
        ])
    if e.kind == "company":
        return rng.choice([
            f"{n} employs about {k(20, 9000)} people.", f"{n} has a branch office in {other('city')}.",
            f"{n} works with {other('company')} on several projects.",
            f"Last year {n} opened a new {rng.choice(FACILITIES)}.", f"Customers praise {n} for its {rng.choice(QUALITIES)}.",
            f"{n} sponsors a {rng.choice(SPORTS)} team.", f"In {k(1950, 2024)}, {n} won an award for its {rng.choice(QUALITIES)}.",
            f"{n} sells its goods in {k(3, 60)} countries.", f"Many people in {other('city')} buy from {n}.",
            f"A manager at {n} once met {other('person')} at a {rng.choice(EVENTS)}.",
            f"The logo of {n} is {rng.choice(COLORS)} and {rng.choice(COLORS)}.",
        ])
    if e.kind == "city":
        return rng.choice([
            f"About {k(2, 900)} thousand people live in {n}.", f"{n} is known for its {rng.choice(CITY_FEATURES)}.",
            f"Every {rng.choice(SEASONS)}, {n} hosts a {rng.choice(EVENTS)}.", f"Many visitors to {n} come from {other('city')}.",
            f"The weather in {n} is often {rng.choice(WEATHER)} in {rng.choice(SEASONS)}.",
            f"A train connects {n} with {other('city')}.", f"The {rng.choice(CITY_FEATURES)} of {n} was built in {k(1200, 1990)}.",
            f"{other('person')} once gave a concert in {n}.", f"{n} has {k(2, 40)} public libraries.",
        ])
    return rng.choice([
        f"{n} weighs about {k(90, 9000)} grams.", f"Reviewers called {n} {rng.choice(ADJS)}.",
        f"{n} comes in {rng.choice(COLORS)} and {rng.choice(COLORS)}.", f"A new version of {n} is planned.",
        f"{n} is popular in {other('city')}.", f"Shops in {other('city')} sell {n} at a low price.",
        f"{n} won a design prize in {k(1960, 2024)}.", f"{other('person')} wrote a review of {n}.",
        f"About {k(2, 900)} thousand units of {n} have been sold.",
    ])


# ------------------------------------------------------------------------------------
# Questions
# ------------------------------------------------------------------------------------
def np_phrase(rng, rel: str, subj: str) -> str:
    """A noun phrase that denotes the object of rel(subj) (first hop of a two-hop question)."""
    return rng.choice({
        "company.founder": [f"the founder of {subj}", f"the person who founded {subj}"],
        "company.ceo": [f"the CEO of {subj}", f"the chief executive of {subj}"],
        "company.hq": [f"the city where {subj} is headquartered", f"the headquarters city of {subj}"],
        "company.product": [f"the product made by {subj}", f"the best known product of {subj}"],
        "product.maker": [f"the company that makes {subj}", f"the maker of {subj}"],
        "person.employer": [f"the company that {subj} works for", f"the employer of {subj}"],
        "person.mother": [f"the mother of {subj}"],
        "person.father": [f"the father of {subj}"],
        "person.birthplace": [f"the city where {subj} was born", f"the birthplace of {subj}"],
        "city.mayor": [f"the mayor of {subj}"],
    }[rel])


def question_frame(rng, rel: str, x: str) -> str:
    return rng.choice({
        "person.birthplace": [f"Where was {x} born?", f"In which city was {x} born?"],
        "person.birth_year": [f"In what year was {x} born?", f"When was {x} born?"],
        "person.mother": [f"Who is the mother of {x}?"],
        "person.father": [f"Who is the father of {x}?"],
        "person.employer": [f"Which company does {x} work for?", f"Who employs {x}?"],
        "person.occupation": [f"What is the profession of {x}?", f"What does {x} do for a living?"],
        "company.founder": [f"Who founded {x}?", f"Who is the founder of {x}?"],
        "company.ceo": [f"Who is the CEO of {x}?", f"Who is the chief executive of {x}?"],
        "company.hq": [f"Where is {x} headquartered?", f"In which city is {x} based?"],
        "company.founded": [f"In which year was {x} founded?", f"When was {x} founded?"],
        "company.product": [f"What product does {x} make?", f"Which product is made by {x}?"],
        "city.country": [f"In which country is {x}?", f"In which country is {x} located?"],
        "city.mayor": [f"Who is the mayor of {x}?"],
        "product.maker": [f"Which company makes {x}?", f"Who makes {x}?"],
        "product.launched": [f"When was {x} launched?", f"In which year was {x} launched?"],
    }[rel])


@dataclass
class QA:
    question: str
    answer: str
    hop: int
    qtype: str
    docs: tuple[str, ...]  # names of the documented entities needed
    bridge: str | None = None  # two-hop: the first hop's value (an entity name)


def single_hop(rng, world, name: str, rel: str) -> QA | None:
    v = rel_value(world, name, rel)
    if v is None:
        return None
    return QA(question_frame(rng, rel, name), v, 1, rel, (name,))


def two_hop(rng, world, name: str, r1: str, r2: str, documented: set[str]) -> QA | None:
    b = rel_value(world, name, r1)
    if b is None or b == name or b not in documented or b not in world:
        return None
    v = rel_value(world, b, r2)
    if v is None or v == name or v == b:
        return None
    return QA(question_frame(rng, r2, np_phrase(rng, r1, name)), v, 2, f"{r1}>{r2}", (name, b), b)


# ------------------------------------------------------------------------------------
# Token counting (exact, given the tokenizer): a text's token count is the sum over its
# Qwen2 pre-tokens of their BPE lengths; BPE never merges across pre-tokens.
# ------------------------------------------------------------------------------------
class TokCounter:
    def __init__(self, tokenizer_path: str | None):
        self.tok = None
        if tokenizer_path:
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(tokenizer_path)
        self.cache: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        if self.tok is None:
            return max(1, round(len(text) / 3.2))  # rough, used before a tokenizer exists
        total = 0
        for p in _PRETOK.findall(text):
            c = self.cache.get(p)
            if c is None:
                c = len(self.tok.encode(p, add_special_tokens=False).ids)
                self.cache[p] = c
            total += c
        return total


DOC_MIN, DOC_MAX = 100, 1000


def sample_doc_target(rng) -> int:
    u = rng.random()
    if u < 0.80:
        return rng.randint(DOC_MIN, 200)
    if u < 0.95:
        return rng.randint(200, 400)
    return rng.randint(400, DOC_MAX - 40)


def write_document(rng, e: Entity, world_names, count: TokCounter, target: int) -> tuple[str, int]:
    intro = intro_sentence(rng, e)
    body = fact_sentences(rng, e)
    rng.shuffle(body)
    n_tok = count(intro) + sum(count(" " + s) for s in body)
    while n_tok < target:
        f = filler_sentence(rng, e, world_names)
        c = count(" " + f)
        if n_tok + c > DOC_MAX:
            break
        body.insert(rng.randint(0, len(body)), f)
        n_tok += c
    return " ".join([intro] + body), n_tok


# ------------------------------------------------------------------------------------
# Examples
# ------------------------------------------------------------------------------------
def make_example(seed: int, index: int, count: TokCounter, hop: int | None = None,
                 n_extra: int = 0, p_two_hop: float = 0.5) -> dict:
    """Example `index` of split `seed`.  hop: force the hop of the main question (else
    two-hop with probability p_two_hop).  n_extra: up to this many further questions
    about the same documents (training only, as follow-up chat turns)."""
    rng = random.Random(f"{seed}:{index}")
    for _attempt in range(100):
        ex = _try_example(rng, count, hop, n_extra, p_two_hop)
        if ex is not None:
            ex["id"] = f"{seed}-{index}"
            return ex
    raise RuntimeError("could not build an example")


def _try_example(rng, count, hop, n_extra, p_two_hop):
    world = build_world(rng)
    names = list(world)
    by_kind: dict[str, list[str]] = {}
    for n, e in world.items():
        by_kind.setdefault(e.kind, []).append(n)
    n_docs = rng.randint(3, 8)
    h = hop if hop is not None else (2 if rng.random() < p_two_hop else 1)
    # main question
    if h == 1:
        rel = rng.choice(list(RELATIONS))
        subj = rng.choice(by_kind[RELATIONS[rel][0]])
        required = [subj]
        main_spec = ("1", subj, rel)
    else:
        r1, r2 = rng.choice(CHAINS)
        subj = rng.choice(by_kind[RELATIONS[r1][0]])
        b = rel_value(world, subj, r1)
        if b is None or b == subj or b not in world:
            return None
        required = [subj, b]
        main_spec = ("2", subj, r1, r2)
    documented = list(dict.fromkeys(required))
    # distractors: often of the same kind as the required entities (confusable)
    for r in required:
        if len(documented) < n_docs and rng.random() < 0.7:
            cands = [x for x in by_kind[world[r].kind] if x not in documented]
            if cands:
                documented.append(rng.choice(cands))
    while len(documented) < n_docs:
        x = rng.choice(names)
        if x not in documented:
            documented.append(x)
    doc_set = set(documented)
    if main_spec[0] == "1":
        qa = single_hop(rng, world, main_spec[1], main_spec[2])
    else:
        qa = two_hop(rng, world, main_spec[1], main_spec[2], main_spec[3], doc_set)
    if qa is None:
        return None
    # the question must not be answerable from a different documented entity by the
    # same surface form: names are unique and relations are functions, so it cannot.
    rng.shuffle(documented)
    docs, n_toks = [], []
    for name in documented:
        d, t = write_document(rng, world[name], by_kind, count, sample_doc_target(rng))
        docs.append(d)
        n_toks.append(t)
    ex = {
        "system": rng.choice(SYSTEM_PROMPTS),
        "documents": docs,
        "question": qa.question,
        "answer": qa.answer,
        "bridge": qa.bridge,
        "hop": qa.hop,
        "answer_doc_indices": sorted(documented.index(x) for x in qa.docs),
        "qtype": qa.qtype,
        "doc_tokens": n_toks,
    }
    if n_extra > 0:
        extras, seen = [], {qa.qtype + "|" + qa.docs[0]}
        for _ in range(8 * n_extra):
            if len(extras) >= n_extra:
                break
            subj = rng.choice(documented)
            if rng.random() < p_two_hop:
                r1, r2 = rng.choice(CHAINS)
                q = two_hop(rng, world, subj, r1, r2, doc_set)
            else:
                q = single_hop(rng, world, subj, rng.choice(list(RELATIONS)))
            if q is None or (q.qtype + "|" + q.docs[0]) in seen:
                continue
            seen.add(q.qtype + "|" + q.docs[0])
            extras.append({"question": q.question, "answer": q.answer, "bridge": q.bridge, "hop": q.hop})
        ex["extra"] = extras
    return ex


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--start", type=int, default=0, help="first example index")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json for exact document lengths")
    ap.add_argument("--heldout", action="store_true", help="alternate hop 1 / hop 2, one question each")
    ap.add_argument("--extra", type=int, default=0, help="follow-up questions per example (training)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    count = TokCounter(a.tokenizer)
    with open(a.out, "w") as f:
        for i in range(a.start, a.start + a.n):
            hop = (1 + (i % 2)) if a.heldout else None
            ex = make_example(a.seed, i, count, hop=hop, n_extra=a.extra)
            f.write(json.dumps(ex, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
