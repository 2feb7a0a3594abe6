"""The official OpenAI Python SDK against `hypic serve` on loopback (issue 22's proof).

Run by tests/sdk/run.sh (which starts the server on the bundled model and mints a
token): HYPIC_URL (…/v1) and HYPIC_TOKEN in the environment. Each check prints one
line; the first failure raises and the script exits non-zero.

The bundled model is too small to choose tools or write JSON on its own: these
checks test the grammar and the parsing (every sampled answer must be well-formed),
not the model's judgement.
"""
import json
import os
import sys

import jsonschema
import openai
from pydantic import BaseModel, Field

client = openai.OpenAI(base_url=os.environ["HYPIC_URL"], api_key=os.environ["HYPIC_TOKEN"])
MODEL = client.models.list().data[0].id

FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


def check(name, ok, detail=""):
    print(f"sdk: {'ok  ' if ok else 'FAIL'} {name} {detail}".rstrip())
    if not ok:
        sys.exit(1)


def json_schema_on_every_seed():
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "forecast", "schema": FORECAST, "strict": True},
            },
            temperature=1.0,
            seed=seed,
            n=2,
            max_tokens=96,
        )
        for c in r.choices:
            v = json.loads(c.message.content)
            jsonschema.validate(v, FORECAST)
            check(f"json_schema seed {seed} choice {c.index}", c.finish_reason == "stop", c.message.content)


class Forecast(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)
    rain: bool


def pydantic_parse():
    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Forecast?"}],
        response_format=Forecast,
        temperature=0.7,
        seed=1,
        max_tokens=96,
    )
    p = r.choices[0].message.parsed
    check("chat.completions.parse with a pydantic model", isinstance(p, Forecast), repr(p))


def forced_tool_call():
    for choice in [{"type": "function", "function": {"name": "get_weather"}}, "required"]:
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=0.8,
            seed=3,
            max_tokens=96,
        )
        c = r.choices[0]
        calls = c.message.tool_calls or []
        check(f"forced call ({choice}): one call", len(calls) == 1 and c.finish_reason == "tool_calls", str(c))
        f = calls[0].function
        tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[f.name]
        jsonschema.validate(json.loads(f.arguments), tool["function"]["parameters"])
        check(f"forced call ({choice}): arguments match", True, f"{f.name}({f.arguments})")


def streamed_tool_call():
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        temperature=1.0,
        seed=4,
        max_tokens=96,
        stream=True,
    )
    name, args, finish = "", "", None
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                name += tc.function.name or ""
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    jsonschema.validate(json.loads(args), WEATHER_TOOL["function"]["parameters"])
    check("streamed forced call", name == "get_weather" and finish == "tool_calls", args)


def tool_round_trip_and_tools_segment_hit():
    convo = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3}"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=convo, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=4)
    check("assistant tool_calls and a tool result are accepted", r.choices[0].finish_reason in ("stop", "length"))
    # Another conversation with the same tools: the tool list is a cached segment.
    r2 = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Time?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        max_tokens=2,
    )
    cached = r2.usage.prompt_tokens_details.cached_tokens
    check("the same tools are a segment hit", cached > 0, f"cached_tokens {cached} of {r2.usage.prompt_tokens}")


def penalties_token_prompts_and_unsupported_fields():
    base = dict(model=MODEL, prompt="The cat sat on", max_tokens=6, temperature=0)
    plain = client.completions.create(**base).choices[0].text
    biased = client.completions.create(**base, logit_bias={"100": 100}).choices[0].text
    check("logit_bias changes the output", biased != plain, repr(biased))
    # A longer greedy answer repeats tokens (" the", "."); penalties change it.
    long = {**base, "max_tokens": 32}
    rep = client.completions.create(**long).choices[0].text
    pen = client.completions.create(**long, frequency_penalty=2.0, presence_penalty=2.0).choices[0].text
    check("presence/frequency penalties change a repeating answer", rep != pen, f"{rep!r} -> {pen!r}")
    try:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"frobnicate": 1}
        )
        check("unsupported field is a 400", False)
    except openai.BadRequestError as e:
        check("unsupported field is a 400 naming it", "frobnicate" in str(e), str(e)[:120])
    try:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}},
        )
        check("bad json_schema name is a 400", False)
    except openai.BadRequestError as e:
        check("bad json_schema name is a 400", "name" in str(e), str(e)[:120])


def token_id_prompt_equals_text():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.environ["HYPIC_TOKENIZER"])
    ids = tok.encode("The cat sat on").ids
    a = client.completions.create(model=MODEL, prompt="The cat sat on", max_tokens=5, temperature=0)
    b = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    check(
        "token-id prompt equals its text",
        a.choices[0].text == b.choices[0].text and a.usage.prompt_tokens == b.usage.prompt_tokens,
        f"{a.choices[0].text!r} {b.choices[0].text!r}",
    )


def responses_api():
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="Hello", max_output_tokens=4)
    # The bundled model may stop before the limit: cut at 4 tokens is `incomplete`
    # (max_output_tokens), fewer tokens end `completed`.
    n = r.usage.output_tokens
    cut = n == 4 and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    done = 0 < n < 4 and r.status == "completed" and r.incomplete_details is None
    check("responses: text", isinstance(r.output_text, str) and (cut or done), f"{r.output_text!r} {n} tokens, {r.status}")
    r = client.responses.create(
        model=MODEL,
        input="Time?",
        tools=[{"type": "function", **TIME_TOOL["function"]}],
        tool_choice={"type": "function", "name": "get_time"},
        parallel_tool_calls=False,
        max_output_tokens=96,
        temperature=1.0,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    check("responses: forced function_call", len(calls) == 1 and calls[0].name == "get_time", str(r.output))
    jsonschema.validate(json.loads(calls[0].arguments), TIME_TOOL["function"]["parameters"])
    r = client.responses.create(
        model=MODEL,
        input="Weather?",
        text={"format": {"type": "json_schema", "name": "forecast", "schema": FORECAST, "strict": True}},
        max_output_tokens=96,
        temperature=1.0,
    )
    jsonschema.validate(json.loads(r.output_text), FORECAST)
    check("responses: json_schema via text.format", True, r.output_text)
    try:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
        check("responses: previous_response_id is a 400", False)
    except openai.BadRequestError as e:
        check("responses: previous_response_id is a 400", "previous_response_id" in str(e))


if __name__ == "__main__":
    print(f"sdk: openai {openai.__version__}, model {MODEL}")
    json_schema_on_every_seed()
    pydantic_parse()
    forced_tool_call()
    streamed_tool_call()
    tool_round_trip_and_tools_segment_hit()
    penalties_token_prompts_and_unsupported_fields()
    token_id_prompt_equals_text()
    responses_api()
    print("sdk: all checks passed")
