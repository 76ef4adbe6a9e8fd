// One Stripe create call through Envoy and the idempotency filter, with stripe-node's own HTTP
// client, timeout and retry loop; run by tests/sdk/test_stripe_node.py:
//
//   node create.mjs PORT RESOURCE SLEEP_MS TIMEOUT_MS MAX_RETRIES
//
// RESOURCE is `customers` or `paymentIntents`; SLEEP_MS is how long the fake Stripe API takes
// for the execution (`metadata[sleep_ms]`); TIMEOUT_MS is the SDK's timeout. Asserts what the
// SDK itself sees (a parsed object, a 200), and prints one JSON line for the Python side to hold
// against the upstream's executions and Envoy's access log: the object, its lastResponse, and
// the attempts the SDK made (its 'request' events).
import assert from 'node:assert/strict';
import Stripe from 'stripe';

const [port, resource, sleepMs, timeoutMs, maxRetries] = process.argv.slice(2);
const stripe = new Stripe('sk_test_fake', {
  host: '127.0.0.1',
  port: Number(port),
  protocol: 'http',
  timeout: Number(timeoutMs),
  maxNetworkRetries: Number(maxRetries),
  telemetry: false,
});

const attempts = [];
const t0 = Date.now();
stripe.on('request', (event) => {
  attempts.push({at_ms: Date.now() - t0, key: event.idempotency_key, path: event.path});
});

const params = {
  customers: {email: 'node@example.com', metadata: {sleep_ms: sleepMs, sdk: 'stripe-node'}},
  paymentIntents: {amount: '4200', currency: 'eur', metadata: {sleep_ms: sleepMs, sdk: 'stripe-node'}},
}[resource];
assert.ok(params, `unknown resource ${resource}`);

const obj = await stripe[resource].create(params);
const elapsedMs = Date.now() - t0;
const last = obj.lastResponse;
assert.equal(last.statusCode, 200);
assert.match(obj.id, /^(cus|pi)_/);
assert.equal(obj.metadata.sdk, 'stripe-node');

console.log(JSON.stringify({
  object: obj,
  status: last.statusCode,
  headers: last.headers,
  idempotency_key: attempts[0]?.key,
  request_id: last.requestId,
  attempts,
  elapsed_ms: elapsedMs,
  sdk_version: Stripe.PACKAGE_VERSION,
}));
