// Calls the plane with the official Node.js NATS client, as any non-Python caller would:
// a plain request to plane.infer.<model> with headers. Prints one JSON line per answer.
//   node call_plane.mjs NATS_URL
import { connect, headers } from "@nats-io/transport-node";

const url = process.argv[2];
const nc = await connect({ servers: url });
const enc = new TextEncoder();
const dec = new TextDecoder();

function answer(kind, msg) {
  const h = msg.headers;
  return {
    kind,
    status: h?.get("Plane-Status"),
    retryAfterMs: h?.get("Retry-After-Ms") || null,
    reason: h?.get("Plane-Reason") || null,
    node: h?.get("Plane-Node") || null,
    body: JSON.parse(dec.decode(msg.data)),
  };
}

// 1. A risk score.
const features = Array.from({ length: 32 }, (_, i) => i / 32);
const h1 = headers();
h1.set("Plane-Deadline-Ms", "200");
h1.set("Plane-Request-Id", "js-risk-1");
const risk = await nc.request("plane.infer.risk", enc.encode(JSON.stringify({ features })),
  { timeout: 5000, headers: h1 });
console.log(JSON.stringify(answer("risk", risk)));

// 2. Hold every calibrated slot busy with long requests, then one more: refused at once.
const n = Number(process.argv[3] || "2");
const long = [];
for (let i = 0; i < n; i++) {
  const h = headers();
  h.set("Plane-Deadline-Ms", "5000");
  long.push(nc.request("plane.infer.calibrated",
    enc.encode(JSON.stringify({ duration_us: 1500000 })), { timeout: 5000, headers: h }));
}
await new Promise((r) => setTimeout(r, 300));
const h2 = headers();
h2.set("Plane-Deadline-Ms", "5000");
const t0 = Date.now();
const refused = await nc.request("plane.infer.calibrated",
  enc.encode(JSON.stringify({ duration_us: 1000 })), { timeout: 5000, headers: h2 });
const refusedIn = Date.now() - t0;
console.log(JSON.stringify({ ...answer("extra", refused), ms: refusedIn }));
for (const m of await Promise.all(long)) console.log(JSON.stringify(answer("long", m)));
await nc.close();
