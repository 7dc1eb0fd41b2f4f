// Reads a plane stream with the official Node.js NATS client, as any non-Python caller would
// (docs/design.md "Streams"): subscribe to an inbox of our own, publish the request with that
// inbox as its reply subject and `Plane-Stream: 1`, then print every message on the inbox
// (one JSON line each) until the final one: any message whose Plane-Stream is not `start` or
// `token`. With CANCEL_AFTER, publish the cancel (an empty message with the stream's
// Plane-Request-Id to the start's Plane-Cancel-Subject) after that many tokens.
//   node stream_plane.mjs NATS_URL PROMPT MAX_TOKENS [CANCEL_AFTER]
import { connect, createInbox, headers } from "@nats-io/transport-node";

const [url, prompt, maxTokens, cancelAfter] = process.argv.slice(2);
const nc = await connect({ servers: url });
const enc = new TextEncoder();
const dec = new TextDecoder();

const inbox = createInbox();
const sub = nc.subscribe(inbox);
await nc.flush(); // the server has the subscription before the request goes out

const h = headers();
h.set("Plane-Stream", "1");
h.set("Plane-Deadline-Ms", "5000");
h.set("Plane-Request-Id", `js-stream-${Date.now()}`);
nc.publish("plane.infer.tinylm",
  enc.encode(JSON.stringify({ prompt, max_tokens: Number(maxTokens) })),
  { reply: inbox, headers: h });

const timer = setTimeout(() => { console.error("no final message in 20 s"); process.exit(2); },
  20000);
let tokens = 0;
let cancelSubject = null;
for await (const m of sub) {
  const kind = m.headers?.get("Plane-Stream") || "";
  console.log(JSON.stringify({
    stream: kind || "final",
    seq: m.headers?.get("Plane-Stream-Seq") || null,
    status: m.headers?.get("Plane-Status") || null,
    cancel: m.headers?.get("Plane-Cancel-Subject") || null,
    body: dec.decode(m.data),
  }));
  if (kind === "start") {
    cancelSubject = m.headers.get("Plane-Cancel-Subject");
  } else if (kind === "token") {
    tokens += 1;
    if (cancelAfter && tokens === Number(cancelAfter)) {
      const c = headers();
      c.set("Plane-Request-Id", h.get("Plane-Request-Id"));
      nc.publish(cancelSubject, new Uint8Array(0), { headers: c });
    }
  } else {
    break; // the one final message: nothing more is read
  }
}
clearTimeout(timer);
await nc.close();
