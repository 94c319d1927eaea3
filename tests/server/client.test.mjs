// `kvq serve` driven by the official OpenAI client: models, chat and
// completions (streamed and not), logprobs, typed errors for bad requests,
// raw-HTTP bad input, the API key, and a client that hangs up mid-stream.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { loadOpenAI, startServer, metric, until, MODEL } from './kvq_server.mjs';

const OpenAI = await loadOpenAI();
let srv, client;

before(async () => {
  srv = await startServer(['--ctx', '512', '--max-body', '1']);
  client = new OpenAI({ baseURL: srv.baseURL, apiKey: 'unused', maxRetries: 0 });
});

after(async () => {
  assert.equal(await srv.stop(), 0, 'kvq serve exits 0 on SIGTERM');
});

const messages = [{ role: 'user', content: 'Write a Python function that reverses a string.' }];

test('lists the served model', async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
  assert.equal((await client.models.retrieve(MODEL)).id, MODEL);
  await assert.rejects(client.models.retrieve('gpt-4o'), OpenAI.NotFoundError);
});

test('chat completion: streamed text equals the non-streamed answer', async () => {
  const r = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 20, temperature: 0 });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices.length, 1);
  const answer = r.choices[0].message.content;
  assert.equal(typeof answer, 'string');
  assert.ok(answer.length > 0);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(r.choices[0].finish_reason, 'length');
  assert.equal(r.usage.completion_tokens, 20);
  assert.ok(r.usage.prompt_tokens > 5);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + 20);

  const stream = await client.chat.completions.create({
    model: MODEL, messages, max_tokens: 20, temperature: 0, stream: true, stream_options: { include_usage: true },
  });
  let text = '', role = null, finish = null, usage = null;
  for await (const chunk of stream) {
    if (chunk.usage && chunk.choices.length === 0) usage = chunk.usage;
    for (const c of chunk.choices) {
      role ??= c.delta.role ?? null;
      text += c.delta.content ?? '';
      finish = c.finish_reason ?? finish;
    }
  }
  assert.equal(role, 'assistant');
  assert.equal(text, answer);
  assert.equal(finish, 'length');
  assert.deepEqual(usage, r.usage);

  // Greedy is deterministic; a fixed seed makes sampling so too.
  const again = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 20, temperature: 0 });
  assert.equal(again.choices[0].message.content, answer);
  const sampled = { model: MODEL, messages, max_tokens: 16, temperature: 1, seed: 5 };
  const s1 = await client.chat.completions.create(sampled);
  const s2 = await client.chat.completions.create(sampled);
  assert.equal(s1.choices[0].message.content, s2.choices[0].message.content);
});

test('completions: streaming, stop strings, logprobs', async () => {
  const base = { model: MODEL, prompt: 'def is_prime(n):\n', max_tokens: 24, temperature: 0 };
  const r = await client.completions.create(base);
  assert.equal(r.object, 'text_completion');
  const text = r.choices[0].text;
  assert.ok(text.length > 0);

  let streamed = '';
  for await (const chunk of await client.completions.create({ ...base, stream: true })) {
    streamed += chunk.choices[0]?.text ?? '';
  }
  assert.equal(streamed, text);

  const stop = text.slice(Math.floor(text.length / 2), Math.floor(text.length / 2) + 2);
  const cut = await client.completions.create({ ...base, stop: [stop] });
  assert.equal(cut.choices[0].text, text.slice(0, text.indexOf(stop)));
  assert.equal(cut.choices[0].finish_reason, 'stop');

  const lp = await client.chat.completions.create({
    model: MODEL, messages, max_tokens: 5, temperature: 0, logprobs: true, top_logprobs: 3,
  });
  const content = lp.choices[0].logprobs.content;
  assert.equal(content.length, 5);
  for (const t of content) {
    assert.ok(t.logprob <= 0);
    assert.equal(t.top_logprobs.length, 3);
    assert.equal(t.top_logprobs[0].logprob, t.logprob);  // greedy took the most likely
    assert.ok(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob);
  }
  assert.equal(content.map((t) => t.token).join(''), lp.choices[0].message.content);
});

test('a message that types control tokens is tokenized as text', async () => {
  const ask = (content) => client.chat.completions.create({ model: MODEL, messages: [{ role: 'user', content }], max_tokens: 1 });
  const plain = await ask('x');
  const typed = await ask('<|im_end|>');
  // As a control token it would be one token, like 'x'; as text it is several.
  assert.ok(typed.usage.prompt_tokens >= plain.usage.prompt_tokens + 3, JSON.stringify([plain.usage, typed.usage]));
});

test('bad requests are typed OpenAI errors', async () => {
  const expectError = async (body, cls, status, code, param) => {
    await assert.rejects(client.chat.completions.create({ model: MODEL, messages, ...body }), (e) => {
      assert.ok(e instanceof cls, `${e.constructor.name}: ${e.message}`);
      assert.equal(e.status, status);
      if (code !== undefined) assert.equal(e.code, code);
      if (param !== undefined) assert.equal(e.param, param);
      return true;
    });
  };
  await expectError({ model: 'gpt-4o' }, OpenAI.NotFoundError, 404, 'model_not_found', 'model');
  await expectError({ max_tokens: 'ten' }, OpenAI.BadRequestError, 400, null, 'max_tokens');
  await expectError({ temperature: 7 }, OpenAI.BadRequestError, 400, null, 'temperature');
  await expectError({ n: 17 }, OpenAI.BadRequestError, 400, null, 'n');
  await expectError({ messages: [] }, OpenAI.BadRequestError, 400, null, 'messages');
  await expectError({ messages: [{ role: 'user', content: 'x = 1\n'.repeat(400) }] }, OpenAI.BadRequestError, 400,
                    'context_length_exceeded', 'messages');
  await expectError({ max_tokens: 100000 }, OpenAI.BadRequestError, 400, 'context_length_exceeded', 'max_tokens');
  await expectError({ kv_codec: 'zip' }, OpenAI.BadRequestError, 400, null, 'kv_codec');
  // One KV pool, one codec: the server's may be named, another is refused naming the server's.
  await assert.rejects(client.chat.completions.create({ model: MODEL, messages, max_tokens: 3, kv_codec: 'k8v4' }), (e) => {
    assert.ok(e instanceof OpenAI.BadRequestError, `${e.constructor.name}: ${e.message}`);
    assert.equal(e.param, 'kv_codec');
    assert.match(e.message, /'none'/);
    return true;
  });
  const r = await client.chat.completions.create({ model: MODEL, messages, max_tokens: 3, kv_codec: 'none' });
  assert.equal(r.usage.completion_tokens, 3);
});

test('raw HTTP bad input gets 4xx envelopes and the server keeps serving', async () => {
  const post = (path, body, headers = { 'Content-Type': 'application/json' }) =>
    fetch(`${srv.url}${path}`, { method: 'POST', body, headers });
  const check = async (res, status, code) => {
    assert.equal(res.status, status);
    const body = await res.json();
    assert.equal(typeof body.error.message, 'string');
    assert.equal(body.error.code, code);
  };
  await check(await post('/v1/chat/completions', '{"messages": [}'), 400, 'invalid_json');
  await check(await post('/v1/chat/completions', Buffer.from('{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 'latin1')),
              400, 'invalid_json');
  await check(await post('/v1/completions', 'x'.repeat(2 * 1024 * 1024)), 413, 'request_too_large');
  await check(await fetch(`${srv.url}/v1/embeddings`), 404, 'unknown_url');
  const health = await fetch(`${srv.url}/health`);
  assert.equal(health.status, 200);
  assert.equal((await health.json()).status, 'ok');
  const ok = await client.completions.create({ model: MODEL, prompt: 'import ', max_tokens: 2 });
  assert.equal(ok.usage.completion_tokens, 2);
});

test('a client that hangs up mid-stream stops its generation', async () => {
  const before = await metric(srv.url, 'kvq_requests_cancelled_total');
  // Greedy repeats this line for thousands of tokens: only cancelling ends it early.
  const stream = await client.completions.create({
    model: MODEL, prompt: 'x = 1\nx = 1\nx = 1\n', max_tokens: 480, temperature: 0, stream: true,
  });
  let got = 0;
  for await (const chunk of stream) {
    if (chunk.choices[0]?.text) got++;
    if (got === 2) break;  // closes the connection
  }
  assert.equal(got, 2);
  await until(async () => (await metric(srv.url, 'kvq_requests_cancelled_total')) === before + 1, 'the cancellation');
  await until(async () => (await metric(srv.url, 'kvq_kv_cache_bytes')) === 0, 'the cache to be freed');
  assert.equal(await metric(srv.url, 'kvq_requests_running'), 0);
});

test('--api-key: /v1 needs the bearer key, /health does not', async () => {
  const keyed = await startServer(['--ctx', '256', '--api-key', 'k-123']);
  try {
    const wrong = new OpenAI({ baseURL: keyed.baseURL, apiKey: 'k-12', maxRetries: 0 });
    await assert.rejects(wrong.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.code === 'invalid_api_key');
    await assert.rejects(wrong.chat.completions.create({ model: MODEL, messages, max_tokens: 1 }),
                         OpenAI.AuthenticationError);
    const right = new OpenAI({ baseURL: keyed.baseURL, apiKey: 'k-123', maxRetries: 0 });
    const r = await right.chat.completions.create({ model: MODEL, messages, max_tokens: 1 });
    assert.equal(r.usage.completion_tokens, 1);
    assert.equal((await fetch(`${keyed.url}/health`)).status, 200);
  } finally {
    assert.equal(await keyed.stop(), 0);
  }
});

test('an SDK abort of a non-streamed request cancels it (the SDK sends Accept-Encoding: gzip)', async () => {
  const before = await metric(srv.url, 'kvq_requests_cancelled_total');
  const ac = new AbortController();
  const req = client.completions.create({ model: MODEL, prompt: 'x = 1\nx = 1\nx = 1\n', max_tokens: 480, temperature: 0 },
                                        { signal: ac.signal });
  await until(async () => (await metric(srv.url, 'kvq_requests_running')) === 1, 'the request to run');
  ac.abort();
  await assert.rejects(req);
  await until(async () => (await metric(srv.url, 'kvq_requests_cancelled_total')) === before + 1, 'the cancellation', 20);
  await until(async () => (await metric(srv.url, 'kvq_requests_running')) === 0, 'the engine to be free', 20);
});

test('SIGTERM drains a running request; a second signal exits at once', async () => {
  const s1 = await startServer(['--ctx', '1024', '--drain-timeout', '60']);
  const c1 = new OpenAI({ baseURL: s1.baseURL, apiKey: 'unused', maxRetries: 0 });
  const running = c1.completions.create({ model: MODEL, prompt: 'x = 1\nx = 1\nx = 1\n', max_tokens: 40, temperature: 0 });
  await until(async () => (await metric(s1.url, 'kvq_requests_running')) === 1, 'the request to run');
  s1.kill('SIGTERM');
  const r = await running;  // finished, not cancelled
  assert.equal(r.usage.completion_tokens, 40);
  assert.equal(await s1.exited, 0);

  const s2 = await startServer(['--ctx', '4096', '--drain-timeout', '600']);
  const c2 = new OpenAI({ baseURL: s2.baseURL, apiKey: 'unused', maxRetries: 0 });
  const endless = c2.completions.create({ model: MODEL, prompt: 'x = 1\nx = 1\nx = 1\n', max_tokens: 3000, temperature: 0 });
  endless.catch(() => {});
  await until(async () => (await metric(s2.url, 'kvq_requests_running')) === 1, 'the request to run');
  s2.kill('SIGTERM');
  await new Promise((res) => setTimeout(res, 300));
  assert.ok(s2.alive(), 'draining, not gone');
  const t0 = Date.now();
  s2.kill('SIGTERM');
  assert.equal(await s2.exited, 128 + 15);
  assert.ok(Date.now() - t0 < 10_000);
});
