// Node handlers for the serverless-offline compatibility test. `exactMatch` mirrors rollfleet's
// exact_match reward (same input and output shape) so the invoker can score through it.
'use strict';

exports.exactMatch = async (event) => {
  if (typeof event.response !== 'string' || typeof event.reference !== 'string') {
    const err = new Error('response and reference must be strings');
    err.name = 'InvalidPayload';
    throw err;
  }
  const matched = event.response.trim() === event.reference.trim();
  return { reward: matched ? 1.0 : 0.0, idempotency_key: event.idempotency_key ?? null };
};

exports.fail = async () => {
  const err = new Error('this reward always fails');
  err.name = 'InvalidPayload';
  throw err;
};

exports.slow = async () => {
  await new Promise((resolve) => setTimeout(resolve, 5000));
  return { reward: 1.0 };
};
