// The duplex-actors web console: talk to `serve` from a browser (OpenAI Realtime GA events over
// the server's own websocket), with the live session chart and the operator view.
// Everything it loads comes from this server; nothing is fetched from anywhere else.
"use strict";

const RATE = 24000; // GA's audio/pcm rate, both ways
const $ = (id) => document.getElementById(id);

// What the page saw, for people (the panels) and for the browser test (window.duplexConsole).
const stats = {
  connected: false,
  url: null,
  sessionId: null,
  sessionType: null, // "realtime", or "transcription" (captions only)
  state: null,
  transitions: [], // {from, to, trigger, at}
  highlights: [], // {node, edge}: what the chart highlighted, each time it changed
  userTranscripts: [], // completed input transcriptions
  assistantTranscripts: [], // done transcripts of responses
  responses: {}, // id -> {status, reason, ttftMs, ttfpMs, rtf, audioMs, heardMs}
  audio: { receivedSamples: 0, scheduledSamples: 0, audibleSamples: 0, lastAudibleAt: -1, outputRate: 0 },
  micChunks: 0,
  audioFrames: { binary: 0, text: 0 }, // how the microphone's chunks went out
  micOnsets: [], // audio-clock times the microphone went loud after a quiet spell
  bargeIns: [], // {at, responseId, itemId, audioEndMs, stopMs}
  truncates: [],
  errors: [],
  events: 0,
};
window.duplexConsole = stats;

let ws = null;
let ctx = null;
let micStream = null;
let captureNode = null;
let meterNode = null;
let eventSeq = 0;
let muted = false;
// The server confirmed the binary-audio extension (session.updated): the microphone's chunks
// go out as raw binary frames, without JSON and base64 (a third fewer bytes, less work at both
// ends). Until then they go as text appends, which a session always takes.
let binaryAudio = false;
// When the user's turn ended as the page saw it (speech_stopped, or a typed message sent):
// the wait column is from there to the answer's first sound.
let turnEndAt = null;

// Playback of the answer: each delta becomes a buffer scheduled right after the previous one.
const play = {
  nextTime: 0,
  sources: [], // {node, start, dur, offsetMs}
  itemId: null,
  responseId: null,
  itemAudioMs: 0, // audio of the current item scheduled so far
  muted: new Set(), // responses the user talked over: their late deltas are not played
};

// ------------------------------------------------------------------ connection

function keyProtocols() {
  const key = $("api-key").value.trim();
  const protocols = ["realtime"];
  if (key) protocols.push("openai-insecure-api-key." + key);
  return protocols;
}

async function connect() {
  if (ws) return;
  setStatus("connecting...");
  // The AudioContext must be made in the click's task (autoplay policy).
  ctx = new AudioContext({ latencyHint: "interactive" });
  await ctx.audioWorklet.addModule("/console/capture-worklet.js");
  await ctx.audioWorklet.addModule("/console/playback-worklet.js");
  meterNode = new AudioWorkletNode(ctx, "duplex-playback-meter", { numberOfInputs: 1, outputChannelCount: [1] });
  meterNode.connect(ctx.destination);
  meterNode.port.onmessage = (e) => {
    stats.audio.audibleSamples = e.data.audible;
    stats.audio.lastAudibleAt = e.data.lastAudibleAt;
    stats.audio.outputRate = e.data.rate;
  };
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  // Captions only: OpenAI's transcription session (its type is chosen when it opens).
  const captions = $("captions").checked;
  const intent = captions ? "?intent=transcription" : "";
  ws = new WebSocket(scheme + location.host + "/v1/realtime" + intent, keyProtocols());
  stats.url = ws.url;
  ws.onopen = () => {
    stats.connected = true;
    setStatus("connected", "live");
    $("hangup").disabled = false;
    $("mute").disabled = false;
    $("connect").disabled = true;
    const input = {
      format: { type: "audio/pcm", rate: RATE },
      turn_detection: { type: "server_vad" },
      transcription: captions || $("transcribe").checked ? { model: "default" } : null,
    };
    send({
      type: "session.update",
      session: {
        type: captions ? "transcription" : "realtime",
        audio: captions ? { input } : { input, output: { format: { type: "audio/pcm", rate: RATE } } },
        // Extensions: duplex.state events drive the live chart; binary audio frames.
        duplex: { state_events: true, binary_audio: true },
      },
    });
    startMic().catch((err) => {
      // Browsers give the microphone only to https pages and to localhost.
      const hint = window.isSecureContext ? "" : " (this page is not https: serve with --tls-cert/--tls-key)";
      setStatus("no microphone: " + err.message + hint + "; you can still type", "error");
      logLine("microphone: " + err, "error");
    });
  };
  ws.onmessage = (e) => onEvent(JSON.parse(e.data));
  ws.onclose = (e) => {
    setStatus(`closed (${e.code}${e.reason ? " " + e.reason : ""})`, e.code === 1000 ? "" : "error");
    teardown();
  };
  ws.onerror = () => setStatus("connection failed (wrong key? see the server's log)", "error");
}

function send(event) {
  if (!ws || ws.readyState !== WebSocket.OPEN) return;
  event.event_id = event.event_id || "console_" + ++eventSeq;
  ws.send(JSON.stringify(event));
  if (event.type !== "input_audio_buffer.append") logLine("→ " + event.type + brief(event), "client");
}

function sendAudio(pcm) {
  if (!ws || ws.readyState !== WebSocket.OPEN) return;
  if (binaryAudio) {
    ws.send(pcm);
    stats.audioFrames.binary++;
    return;
  }
  send({ type: "input_audio_buffer.append", audio: toBase64(new Uint8Array(pcm)) });
  stats.audioFrames.text++;
}

function teardown() {
  stopPlayback();
  if (micStream) micStream.getTracks().forEach((t) => t.stop());
  micStream = null;
  if (captureNode) captureNode.disconnect();
  captureNode = null;
  ws = null;
  binaryAudio = false;
  stats.connected = false;
  $("hangup").disabled = true;
  $("mute").disabled = true;
  $("connect").disabled = false;
}

// Muted, the page sends no audio and drops what the server holds of it (the turn detector's
// padding), so the session can be idle: with a live microphone under server VAD it is
// listening (audio buffered) whenever it is not responding.
function toggleMute() {
  muted = !muted;
  $("mute").textContent = muted ? "Unmute mic" : "Mute mic";
  if (muted) send({ type: "input_audio_buffer.clear" });
}

function hangup() {
  if (!ws) return;
  send({ type: "session.close" });
  setTimeout(() => ws && ws.close(1000), 500);
}

// ------------------------------------------------------------------ microphone

async function startMic() {
  micStream = await navigator.mediaDevices.getUserMedia({
    audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
  });
  const source = ctx.createMediaStreamSource(micStream);
  captureNode = new AudioWorkletNode(ctx, "duplex-capture", {
    processorOptions: { outRate: RATE, chunkMs: 40 },
  });
  captureNode.port.onmessage = (e) => {
    stats.micChunks++;
    noteOnset(e.data.peak, e.data.at);
    $("mic-level").firstElementChild.style.width = Math.min(100, Math.round(e.data.peak * 140)) + "%";
    if (!muted) sendAudio(e.data.pcm);
  };
  source.connect(captureNode);
  // The capture node must be pulled by the graph to run; it outputs silence.
  const sink = ctx.createGain();
  sink.gain.value = 0;
  captureNode.connect(sink).connect(ctx.destination);
  setStatus("listening: speak", "live");
}

// ------------------------------------------------------------------ events

function onEvent(ev) {
  stats.events++;
  $("event-count").textContent = String(stats.events);
  if (ev.type !== "response.output_audio.delta") logLine("← " + ev.type + brief(ev), ev.type === "error" ? "error" : "");
  switch (ev.type) {
    case "session.created":
      stats.sessionId = ev.session.id;
      stats.sessionType = ev.session.type;
      setStatus((ev.session.type === "transcription" ? "captions " : "session ") + ev.session.id, "live");
      break;
    case "session.updated":
      // The page sends one update, so its answer is the state it asked for.
      binaryAudio = !!(ev.session.duplex && ev.session.duplex.binary_audio);
      break;
    case "duplex.state":
      onState(ev);
      break;
    case "input_audio_buffer.speech_started":
      bargeIn();
      break;
    case "input_audio_buffer.speech_stopped":
      turnEndAt = performance.now();
      break;
    case "conversation.item.input_audio_transcription.completed":
      stats.userTranscripts.push(ev.transcript);
      turnText(ev.item_id, "user", ev.transcript || "(nothing heard)");
      break;
    case "conversation.item.input_audio_transcription.failed":
      turnText(ev.item_id, "user", "(transcription failed: " + (ev.error && ev.error.message) + ")");
      break;
    case "conversation.item.added":
      if (ev.item.role === "user" && ev.item.content) {
        const text = ev.item.content.filter((c) => c.type === "input_text").map((c) => c.text).join(" ");
        turnText(ev.item.id, "user", text || "…");
      }
      break;
    case "response.created":
      responseRow(ev.response.id, { status: "in_progress" });
      break;
    case "response.output_item.added":
      if (ev.item.type === "message") {
        play.itemId = ev.item.id;
        play.responseId = ev.response_id;
        play.itemAudioMs = 0;
        turnText(ev.item.id, "assistant", "");
      }
      break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      appendTurn(ev.item_id, "assistant", ev.delta);
      noteMetrics(ev);
      break;
    case "response.output_audio.delta":
      noteMetrics(ev);
      if (!play.muted.has(ev.response_id)) schedule(ev);
      break;
    case "response.output_audio_transcript.done":
      stats.assistantTranscripts.push(ev.transcript);
      break;
    case "response.done":
      onResponseDone(ev.response);
      break;
    case "conversation.item.truncated":
      stats.truncates.push({ itemId: ev.item_id, audioEndMs: ev.audio_end_ms });
      break;
    case "error":
      stats.errors.push(ev.error);
      break;
    case "session.closed":
      setState("closed", null, ev.reason);
      break;
  }
}

function noteMetrics(ev) {
  const m = ev.metrics;
  if (!m) return;
  const row = stats.responses[ev.response_id] || {};
  if (m.ttft_ms != null && row.ttftMs == null) row.ttftMs = m.ttft_ms;
  if (m.ttfp_ms != null && row.ttfpMs == null) row.ttfpMs = m.ttfp_ms;
  responseRow(ev.response_id, row);
}

function onResponseDone(r) {
  const m = r.metrics || {};
  const details = r.status_details || {};
  const row = {
    status: r.status,
    reason: details.reason || details.duplex_reason || null,
    ttftMs: m.ttft_ms,
    ttfpMs: m.ttfp_ms,
    rtf: m.rtf,
    audioMs: m.audio_ms,
  };
  responseRow(r.id, row);
  if (r.status === "cancelled") {
    for (const item of r.output || []) {
      const el = document.querySelector(`[data-item="${item.id}"]`);
      if (el) el.classList.add("cancelled");
    }
  }
}

// ------------------------------------------------------------------ playback and barge-in

function schedule(ev) {
  const bytes = fromBase64(ev.delta);
  const samples = bytes.length >> 1;
  if (!samples) return;
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const rate = ev.sample_rate || RATE;
  const buffer = ctx.createBuffer(1, samples, rate);
  const out = buffer.getChannelData(0);
  for (let i = 0; i < samples; i++) out[i] = view.getInt16(i * 2, true) / 0x8000;
  const node = ctx.createBufferSource();
  node.buffer = buffer;
  node.connect(meterNode);
  // A small lead on the first packet absorbs jitter; later ones follow back to back.
  const start = Math.max(ctx.currentTime + 0.03, play.nextTime);
  node.start(start);
  const row = stats.responses[ev.response_id] || {};
  if (row.waitMs == null && turnEndAt != null) {
    row.waitMs = performance.now() - turnEndAt + (start - ctx.currentTime) * 1000;
    turnEndAt = null;
    responseRow(ev.response_id, row);
  }
  const entry = { node, start, dur: buffer.duration, offsetMs: play.itemAudioMs, itemId: ev.item_id };
  play.sources.push(entry);
  node.onended = () => {
    const i = play.sources.indexOf(entry);
    if (i >= 0) play.sources.splice(i, 1);
  };
  play.nextTime = start + buffer.duration;
  play.itemAudioMs += buffer.duration * 1000;
  stats.audio.receivedSamples += samples;
  stats.audio.scheduledSamples += samples;
}

// Milliseconds of the current item the user has heard: what its buffers played until now.
function heardMs(itemId) {
  const now = ctx.currentTime;
  let heard = 0;
  for (const s of play.sources) {
    if (s.itemId !== itemId) continue;
    if (now >= s.start) heard = Math.max(heard, s.offsetMs + Math.min(now - s.start, s.dur) * 1000);
  }
  if (!play.sources.some((s) => s.itemId === itemId)) heard = play.itemAudioMs; // all of it played
  return Math.floor(heard);
}

function playing() {
  return ctx && play.sources.length > 0 && play.nextTime > ctx.currentTime;
}

// GA barge-in: the user speaks over the answer, so stop it now and tell the server how much
// was heard (conversation.item.truncate). Cancelling is the server's (turn detection).
function bargeIn() {
  if (!playing()) return;
  const at = ctx.currentTime;
  const itemId = play.itemId;
  const responseId = play.responseId;
  const audioEndMs = heardMs(itemId);
  stopPlayback();
  play.muted.add(responseId);
  const onset = stats.micOnsets[stats.micOnsets.length - 1];
  // speech onset at the microphone to playback stopped: the server's VAD and the network are in it
  const fromOnsetMs = onset == null ? null : Math.round((at - onset) * 1000);
  const record = { at, responseId, itemId, audioEndMs, stopMs: null, fromOnsetMs };
  stats.bargeIns.push(record);
  send({ type: "conversation.item.truncate", item_id: itemId, content_index: 0, audio_end_ms: audioEndMs });
  const who = document.querySelector(`[data-item="${itemId}"] .who`);
  if (who) who.textContent = `assistant (you talked over it: heard ${audioEndMs} ms)`;
  const row = stats.responses[responseId] || {};
  row.heardMs = audioEndMs;
  responseRow(responseId, row);
  // How long the speakers still sounded after the stop, as the meter rendered it.
  setTimeout(() => {
    record.stopMs = Math.round((stats.audio.lastAudibleAt - at) * 10000) / 10;
  }, 300);
}

let quietSince = 0;
function noteOnset(peak, at) {
  if (peak < 0.02) {
    if (!quietSince) quietSince = at;
  } else if (peak > 0.05) {
    if (quietSince && at - quietSince > 0.3) stats.micOnsets.push(at);
    quietSince = 0;
  }
}

function stopPlayback() {
  for (const s of play.sources) {
    try {
      s.node.onended = null;
      s.node.stop();
      s.node.disconnect();
    } catch (_) {
      /* already stopped */
    }
  }
  play.sources = [];
  play.nextTime = 0;
}

// ------------------------------------------------------------------ the live chart

const chart = { nodes: new Map(), edges: [] };

async function loadChart() {
  const res = await fetch("/console/session.svg");
  const text = await res.text();
  const doc = new DOMParser().parseFromString(text, "image/svg+xml");
  const svg = doc.documentElement;
  svg.removeAttribute("width");
  svg.removeAttribute("height");
  $("chart").replaceChildren(document.importNode(svg, true));
  for (const g of $("chart").querySelectorAll("g.node")) {
    chart.nodes.set(g.querySelector("title").textContent, g);
  }
  for (const g of $("chart").querySelectorAll("g.edge")) {
    const [from, to] = g.querySelector("title").textContent.split("->");
    const label = g.querySelector("text");
    // "a | b [guard]" (or with "/ effects"): the triggers are the words before [ or /.
    const head = label ? label.textContent.split(/[[/]/)[0] : "";
    const triggers = head.split("|").map((t) => t.trim()).filter(Boolean);
    chart.edges.push({ from, to, triggers, g });
  }
  if (stats.state) highlight(stats.state, stats.transitions[stats.transitions.length - 1]);
}

function onState(ev) {
  const t = { from: ev.from, to: ev.to, trigger: ev.trigger, at: performance.now() };
  stats.transitions.push(t);
  setState(ev.to, t);
}

function setState(state, transition, note) {
  stats.state = state;
  $("chart-state").textContent = state;
  $("chart-last").textContent = transition
    ? transition.from === transition.to
      ? `(${transition.trigger})`
      : `${transition.from} → ${transition.to} on ${transition.trigger}`
    : note || "";
  highlight(state, transition);
}

function highlight(state, transition) {
  for (const g of $("chart").querySelectorAll(".current, .last")) g.classList.remove("current", "last");
  const node = chart.nodes.get(state);
  if (node) node.classList.add("current");
  if (transition && transition.from !== transition.to) {
    const edges = chart.edges.filter((e) => e.from === transition.from && e.to === transition.to);
    const exact = edges.filter((e) => e.triggers.includes(transition.trigger));
    for (const e of exact.length ? exact : edges) e.g.classList.add("last");
  }
  // What the chart now shows, read back from the drawing (the browser test checks this).
  const shown = $("chart").querySelector("g.node.current title");
  const edge = $("chart").querySelector("g.edge.last title");
  stats.highlights.push({ node: shown && shown.textContent, edge: edge && edge.textContent });
}

// ------------------------------------------------------------------ operator view

async function pollOperator() {
  const key = $("api-key").value.trim();
  try {
    const res = await fetch("/v1/operator", { headers: key ? { Authorization: "Bearer " + key } : {} });
    if (res.ok) {
      const o = await res.json();
      const lag = o.loop_lag_ms;
      $("operator").textContent =
        `engine ${o.engine}  connections ${o.connections}\n` +
        `sessions ${o.sessions.open}: ` +
        Object.entries(o.sessions.by_state).map(([s, n]) => `${s} ${n}`).join(", ") +
        `  (detached ${o.sessions.detached})\n` +
        `engine in flight ${o.engine_requests.in_flight}  (completed ${o.engine_requests.completed}, aborted ${o.engine_requests.aborted}, failed ${o.engine_requests.failed})\n` +
        `queues: mailboxes ${o.queues.mailbox_total} (max ${o.queues.mailbox_max}), ready ${o.queues.sessions_ready}\n` +
        `loop lag ms: ${lag ? `last ${lag.last}, max ${lag.max}, mean ${lag.mean} over ${lag.window_s} s` : "measuring"}\n\n` +
        o.sessions.listed.map((s) => `${s.id}  ${s.state}  epoch ${s.epoch}  mailbox ${s.mailbox}${s.detached ? "  detached" : ""}`).join("\n");
    } else {
      $("operator").textContent = `HTTP ${res.status}: ${await res.text()}`;
    }
  } catch (err) {
    $("operator").textContent = String(err);
  }
}

// The operator view refreshes while connected, or while a key is entered (an operator may
// watch without talking); without either it would only collect 401s.
function operatorLoop() {
  if (ws || $("api-key").value.trim()) pollOperator();
  setTimeout(operatorLoop, 2000);
}

// ------------------------------------------------------------------ panels

function setStatus(text, cls) {
  const el = $("status");
  el.textContent = text;
  el.className = "status " + (cls || "");
}

function turnText(itemId, who, text) {
  let el = document.querySelector(`[data-item="${itemId}"]`);
  if (!el) {
    el = document.createElement("div");
    el.className = "turn " + who;
    el.dataset.item = itemId;
    const label = document.createElement("span");
    label.className = "who";
    label.textContent = who === "user" ? "you" : "assistant";
    const body = document.createElement("span");
    body.className = "text";
    el.append(label, body);
    $("transcript").append(el);
  }
  el.querySelector(".text").textContent = text;
  $("transcript").scrollTop = $("transcript").scrollHeight;
}

function appendTurn(itemId, who, delta) {
  const el = document.querySelector(`[data-item="${itemId}"] .text`);
  if (!el) return turnText(itemId, who, delta);
  el.textContent += delta;
}

function responseRow(id, fields) {
  const row = (stats.responses[id] = Object.assign(stats.responses[id] || {}, fields));
  let tr = document.querySelector(`tr[data-response="${id}"]`);
  if (!tr) {
    tr = document.createElement("tr");
    tr.dataset.response = id;
    $("responses").tBodies[0].append(tr);
  }
  const f = (v, d = 0) => (v == null ? "-" : Number(v).toFixed(d));
  const status = row.status + (row.reason ? ` (${row.reason})` : "");
  const cells = [id, status, f(row.ttftMs), f(row.ttfpMs), f(row.waitMs), f(row.rtf, 2), f(row.audioMs), f(row.heardMs)];
  tr.replaceChildren(...cells.map((c) => Object.assign(document.createElement("td"), { textContent: c })));
}

function logLine(text, cls) {
  const li = document.createElement("li");
  li.textContent = text;
  if (cls) li.className = cls;
  const log = $("log");
  log.append(li);
  while (log.children.length > 300) log.firstChild.remove();
  log.scrollTop = log.scrollHeight;
}

function brief(ev) {
  switch (ev.type) {
    case "duplex.state":
      return ` ${ev.from} → ${ev.to} (${ev.trigger})`;
    case "response.done":
      return ` ${ev.response.status}` + (ev.response.status_details ? ` ${ev.response.status_details.reason || ""}` : "");
    case "error":
      return ` ${ev.error.code}: ${ev.error.message}`;
    case "conversation.item.truncate":
    case "conversation.item.truncated":
      return ` ${ev.item_id} at ${ev.audio_end_ms} ms`;
    case "conversation.item.input_audio_transcription.completed":
      return ` "${ev.transcript}"`;
    default:
      return "";
  }
}

function toBase64(bytes) {
  let s = "";
  for (let i = 0; i < bytes.length; i += 0x8000) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(s);
}

function fromBase64(text) {
  const s = atob(text);
  const out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}

// ------------------------------------------------------------------ wiring

window.addEventListener("DOMContentLoaded", () => {
  $("connect-form").addEventListener("submit", (e) => {
    e.preventDefault();
    connect().catch((err) => {
      setStatus(String(err), "error");
      teardown();
    });
  });
  $("hangup").addEventListener("click", hangup);
  $("mute").addEventListener("click", toggleMute);
  $("text-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("text-input").value.trim();
    if (!text || !ws) return;
    send({ type: "conversation.item.create", item: { type: "message", role: "user", content: [{ type: "input_text", text }] } });
    if (stats.sessionType !== "transcription") send({ type: "response.create" }); // captions: nothing answers
    turnEndAt = performance.now();
    $("text-input").value = "";
  });
  const key = new URLSearchParams(location.hash.slice(1)).get("key");
  if (key) $("api-key").value = key; // #key=... (kept out of server logs: fragments are not sent)
  loadChart().catch((err) => ($("chart").textContent = "chart: " + err));
  operatorLoop();
});
