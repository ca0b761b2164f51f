// The official Node `openai` SDK's realtime WebSocket client (OpenAIRealtimeWS), unmodified,
// against `duplex-actors serve` over TLS: a text turn, then a push-to-talk audio turn.
// tests/interop/test_node_openai.py starts the server and runs this with:
//   OPENAI_BASE_URL  https://127.0.0.1:PORT/v1 (the SDK turns it into wss://.../v1/realtime)
//   OPENAI_API_KEY   the server's --api-key
//   SPEECH_PCM       a file of pcm16 mono 24 kHz speech
//   NODE_EXTRA_CA_CERTS  the server's self-signed certificate (Node's own trust store option)
// It prints one JSON line with what it saw and exits non-zero on a failed turn.
import fs from "node:fs";
import OpenAI from "openai";
import { OpenAIRealtimeWS } from "openai/realtime/ws";

const TIMEOUT_MS = 30_000;
const client = new OpenAI({ apiKey: process.env.OPENAI_API_KEY, baseURL: process.env.OPENAI_BASE_URL });
const rt = new OpenAIRealtimeWS({ model: "gpt-realtime" }, client);
const seen = { url: rt.url.toString(), types: {}, errors: [], turns: [] };

function next(type, predicate = () => true) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no ${type} within ${TIMEOUT_MS} ms`)), TIMEOUT_MS);
    const on = (event) => {
      if (!predicate(event)) return;
      clearTimeout(timer);
      rt.off(type, on);
      resolve(event);
    };
    rt.on(type, on);
  });
}

// One response: what it said (transcript or text) and how much audio came with it.
async function response() {
  let audioBytes = 0;
  let words = "";
  const onAudio = (e) => (audioBytes += Buffer.from(e.delta, "base64").length);
  const onWords = (e) => (words += e.delta);
  rt.on("response.output_audio.delta", onAudio);
  rt.on("response.output_audio_transcript.delta", onWords);
  rt.on("response.output_text.delta", onWords);
  const done = await next("response.done");
  rt.off("response.output_audio.delta", onAudio);
  rt.off("response.output_audio_transcript.delta", onWords);
  rt.off("response.output_text.delta", onWords);
  return { status: done.response.status, audioBytes, words, usage: done.response.usage };
}

rt.on("event", (e) => (seen.types[e.type] = (seen.types[e.type] || 0) + 1));
rt.on("error", (err) => seen.errors.push(String(err && (err.message || err.error?.message || err))));

try {
  await new Promise((resolve, reject) => {
    rt.socket.once("open", resolve);
    rt.socket.once("error", reject);
  });
  const created = await next("session.created");
  seen.session = created.session.id;
  // Push-to-talk: the client commits and asks for each response itself.
  rt.send({
    type: "session.update",
    session: { type: "realtime", output_modalities: ["audio"], audio: { input: { turn_detection: null } } },
  });
  await next("session.updated");

  // 1. A text turn.
  rt.send({
    type: "conversation.item.create",
    item: { type: "message", role: "user", content: [{ type: "input_text", text: "Hello over TLS." }] },
  });
  rt.send({ type: "response.create" });
  seen.turns.push({ kind: "text", ...(await response()) });

  // 2. An audio turn: 100 ms appends of real speech, commit, response.create.
  const pcm = fs.readFileSync(process.env.SPEECH_PCM);
  const step = 2400 * 2;
  for (let i = 0; i < pcm.length; i += step) {
    rt.send({ type: "input_audio_buffer.append", audio: pcm.subarray(i, i + step).toString("base64") });
  }
  rt.send({ type: "input_audio_buffer.commit" });
  const committed = await next("input_audio_buffer.committed");
  rt.send({ type: "response.create" });
  seen.turns.push({ kind: "audio", committedMs: committed.audio_ms ?? null, ...(await response()) });
} catch (err) {
  seen.errors.push(String(err && err.message ? err.message : err));
} finally {
  rt.close();
}
console.log(JSON.stringify(seen));
const ok = seen.errors.length === 0 && seen.turns.length === 2 && seen.turns.every((t) => t.status === "completed");
process.exit(ok ? 0 : 1);
