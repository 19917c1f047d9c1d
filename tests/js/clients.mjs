// The npm clients a store's developers use, against a live server: `ollama` (ollama-js) and
// the AI SDK with its Ollama provider (`ai` + `ollama-ai-provider-v2`). Reads the case file
// tests/test_client_libraries.py writes (server URL, model, tools, seeds, limits) and prints
// one JSON object with what each client returned. It asserts nothing itself: the Python test
// judges the answers (tool arguments against the schemas sent, the answer texts against the
// box's own instructions), so that a failure reads as one pytest report.
import { readFileSync } from "node:fs";

import { generateText, jsonSchema, tool } from "ai";
import { Ollama } from "ollama";
import { createOllama } from "ollama-ai-provider-v2";

const spec = JSON.parse(readFileSync(process.argv[2], "utf8"));
const client = new Ollama({ host: spec.url });
const provider = createOllama({ baseURL: `${spec.url}/api` });
const nestedName = spec.nested_tool.function.name;
const out = {};

// ollama-js, a tool offered in "auto" mode: the model may answer in words, over seeds.
out.ollama_auto = [];
for (const seed of spec.seeds) {
  const r = await client.chat({
    model: spec.model,
    messages: [{ role: "user", content: spec.prompt }],
    tools: [spec.simple_tool],
    options: { seed, num_predict: spec.answer_tokens },
  });
  out.ollama_auto.push({ content: r.message.content, tool_calls: r.message.tool_calls ?? [] });
}

// ollama-js with a nested schema ($defs/$ref), the tool named in `tool_choice` (not an
// ollama-js field: it sends the request object as given).
const nested = await client.chat({
  model: spec.model,
  messages: [{ role: "user", content: spec.nested_prompt }],
  tools: [spec.nested_tool],
  tool_choice: { type: "function", function: { name: nestedName } },
  options: { temperature: 0, num_predict: spec.tool_tokens },
});
out.ollama_nested = { content: nested.message.content, tool_calls: nested.message.tool_calls ?? [] };

// The AI SDK's provider with settings: it sends temperature, top_p and max_output_tokens at
// the top level of /api/chat, beside `options`.
const plain = await generateText({
  model: provider(spec.model),
  prompt: spec.prompt,
  temperature: 0,
  topP: 0.9,
  maxOutputTokens: spec.answer_tokens,
});
out.ai_settings = {
  text: plain.text,
  finishReason: plain.finishReason,
  outputTokens: plain.usage.outputTokens,
  ignored: plain.response.headers?.["x-edge-ignored"] ?? null,
};

// The AI SDK's provider with a tool call: tool_choice {type: "function", name} (the flat
// form it sends) and the nested schema as JSON Schema.
const called = await generateText({
  model: provider(spec.model),
  prompt: spec.nested_prompt,
  temperature: 0,
  maxOutputTokens: spec.tool_tokens,
  tools: {
    [nestedName]: tool({
      description: spec.nested_tool.function.description,
      inputSchema: jsonSchema(spec.nested_tool.function.parameters),
    }),
  },
  toolChoice: { type: "tool", toolName: nestedName },
});
out.ai_tool = {
  finishReason: called.finishReason,
  toolCalls: called.toolCalls.map((c) => ({ toolName: c.toolName, input: c.input })),
  ignored: called.response.headers?.["x-edge-ignored"] ?? null,
};

console.log(JSON.stringify(out));
