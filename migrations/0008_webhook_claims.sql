-- The claim a dispatcher holds on a delivery it is sending: set when it is claimed, checked when
-- its attempt is recorded, so a dispatcher whose claim expired (and another took the delivery)
-- or was replayed meanwhile cannot settle it.
ALTER TABLE webhook_deliveries ADD COLUMN claim uuid;
