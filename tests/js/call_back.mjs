// A ticket's holder on call, with the official Node.js NATS client (docs/design.md
// "Retry-After that is worth trusting"): send the request with an inbox of our own as
// Plane-Wake; when refused (429 with a ticket), wait for a call on that inbox (a message
// carrying the ticket) or the Retry-After, whichever comes first, then come back with the
// ticket. Prints one JSON line per step.
//   node call_back.mjs NATS_URL MODEL BODY_JSON
import { connect, createInbox, headers } from "@nats-io/transport-node";

const [url, model, body] = process.argv.slice(2);
const nc = await connect({ servers: url });
const enc = new TextEncoder();
const inbox = createInbox();
const calls = nc.subscribe(inbox);
await nc.flush(); // the server has the subscription before anyone could call it

const h = headers();
h.set("Plane-Deadline-Ms", "5000");
h.set("Plane-Wake", inbox);
const refused = await nc.request(`plane.infer.${model}`, enc.encode(body),
  { timeout: 5000, headers: h });
const ticket = refused.headers?.get("Plane-Ticket") || null;
const retryAfterMs = Number(refused.headers?.get("Retry-After-Ms") || "0");
console.log(JSON.stringify({ kind: "refused", status: refused.headers?.get("Plane-Status"),
  ticket, retryAfterMs }));
const t0 = Date.now();
let calledWith = null;
const timer = setTimeout(() => calls.unsubscribe(), retryAfterMs);
for await (const call of calls) {
  calledWith = call.headers?.get("Plane-Ticket") || null;
  break;
}
clearTimeout(timer);
console.log(JSON.stringify({ kind: "called", calledWith, afterMs: Date.now() - t0 }));
const back = headers();
back.set("Plane-Deadline-Ms", "5000");
back.set("Plane-Ticket", ticket);
const answer = await nc.request(`plane.infer.${model}`, enc.encode(body),
  { timeout: 5000, headers: back });
console.log(JSON.stringify({ kind: "back", status: answer.headers?.get("Plane-Status") }));
await nc.close();
