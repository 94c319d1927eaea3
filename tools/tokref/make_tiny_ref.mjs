// Reference ids for the embedded model's tokenizer (models/kvq-tiny-code.tokenizer.json,
// `"normalizer": null`) on text that is not in NFC, computed by an independent
// implementation (@lenml/tokenizers, a port of transformers.js):
//
//   cd tools/tokref && npm ci && node make_tiny_ref.mjs
//
// Writes tests/data/tokenizer/kvq_tiny_code_nonnfc_ref.jsonl ({"text", "ids"} per line).
// It first checks that the port agrees with the Hugging Face ids recorded at
// training time (tests/data/tokenizer/kvq_tiny_code_ref.jsonl) and stops if not.
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { TokenizerLoader } from "@lenml/tokenizers";

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(here, "..", "..");
const data = path.join(root, "tests", "data", "tokenizer");

const tok = TokenizerLoader.fromPreTrained({
  tokenizerJSON: JSON.parse(fs.readFileSync(path.join(root, "models", "kvq-tiny-code.tokenizer.json"), "utf8")),
  tokenizerConfig: {},
});
const encode = (text) => Array.from(tok.encode(text, { add_special_tokens: false }), Number);

const hf = fs.readFileSync(path.join(data, "kvq_tiny_code_ref.jsonl"), "utf8").split("\n").filter((l) => l)
  .map((l) => JSON.parse(l));
for (const r of hf) {
  const got = encode(r.text);
  if (JSON.stringify(got) !== JSON.stringify(r.ids)) {
    console.error(`the JS port disagrees with Hugging Face on ${JSON.stringify(r.text.slice(0, 60))}`);
    process.exit(1);
  }
}
console.log(`JS port agrees with the Hugging Face ids on ${hf.length} lines`);

const cases = [
  "cafe\u0301",                       // e + COMBINING ACUTE (NFC: é)
  "cafe\u0301 au lait",
  "print('nai\u0308ve')",             // i + COMBINING DIAERESIS inside code
  "A\u030a",                          // A + COMBINING RING ABOVE (NFC: Å)
  "\u212b ngstrom",                   // ANGSTROM SIGN, a singleton (NFC: U+00C5)
  "\u2126 = 1/S",                     // OHM SIGN (NFC: GREEK CAPITAL OMEGA)
  "e\u0301\u0323",                    // marks out of canonical order (NFC reorders and composes)
  "\u1100\u1161\u11a8",               // conjoining jamo (NFC: one syllable)
  "\u0958",                           // DEVANAGARI QA, a composition exclusion (NFC: two code points)
  "x = \"re\u0301sume\u0301\"  # \u00e9 precomposed",
];
const lines = cases.map((text) => JSON.stringify({ text, ids: encode(text) }));
fs.writeFileSync(path.join(data, "kvq_tiny_code_nonnfc_ref.jsonl"), lines.join("\n") + "\n");
console.log(`wrote ${lines.length} lines to tests/data/tokenizer/kvq_tiny_code_nonnfc_ref.jsonl`);
